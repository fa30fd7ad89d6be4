"""Performer as a token mixer: FAVOR+ linear attention, bidirectional or causal, with a fixed-size state.

Options (``config.mixer_options["performer"]``):

- ``features`` (default ``round(hs·ln hs)``, the paper's choice): random features ``m``.
- ``orthogonal`` (default True): orthogonal random features (lower variance) or i.i.d. ones.
- ``redraw_interval`` (default 1000; ``0`` = never): draw a fresh projection every that many
  training forward calls, as the paper does so that no single draw's error is learned around.
- ``chunk`` (default 64): tokens per chunk of the causal prefix sums.

The projection ``(m, hs)`` is a buffer saved with the weights, so a reloaded model computes the
same function. Generation keeps ``S = Σ φ(k) vᵀ`` (``m × hs``) and ``z = Σ φ(k)`` (``m``) per head:
:class:`FavorState`, the same size at token 10 and at token 10 000, and the same class for eager and
static decoding (the sums do not depend on positions).
"""

from __future__ import annotations

import math

import torch

from tformer.ops.performer import favor_attention, favor_causal, gaussian_orthogonal, softmax_features
from tformer.config import TransformerConfig
from tformer.errors import ConfigError
from tformer.mixers.base import Shared, Step
from tformer.mixers.projected import ProjectedAttention

Tensor = torch.Tensor


def default_features(head_dim: int) -> int:
    return max(1, round(head_dim * math.log(head_dim))) if head_dim > 1 else 1


class FavorState:
    """Running sums of one layer: ``S (B, nh, m, hs)`` and ``z (B, nh, m)`` (fp32 or wider)."""

    def __init__(self, batch_size: int, n_heads: int, m: int, head_dim: int, dtype, device):
        dtype = torch.promote_types(dtype, torch.float32)
        self.S = torch.zeros(batch_size, n_heads, m, head_dim, dtype=dtype, device=device)
        self.z = torch.zeros(batch_size, n_heads, m, dtype=dtype, device=device)

    def reset(self) -> None:
        """Forget every token: the sums start from zero again."""
        self.S.zero_()
        self.z.zero_()

    @property
    def nbytes(self) -> int:
        return self.S.nbytes + self.z.nbytes


class PerformerAttention(ProjectedAttention):
    """FAVOR+ attention (Choromanski et al., 2021); protocol of :mod:`tformer.mixers.base`."""

    name = "performer"
    OPTIONS = ("features", "orthogonal", "redraw_interval", "chunk")

    def __init__(self, config: TransformerConfig, layer: int = 0, shared: Shared | None = None):
        super().__init__(config, layer, shared)
        self.m = self.option("features", default_features(config.head_dim))
        self.orthogonal = bool(self.option("orthogonal", True))
        self.redraw_interval = self.option("redraw_interval", 1000)
        self.chunk = self.option("chunk", 64)
        self.register_buffer("projection", gaussian_orthogonal(self.m, config.head_dim, orthogonal=self.orthogonal))
        self.calls = 0

    @torch.no_grad()
    def redraw(self) -> None:
        """A fresh projection (from torch's global generator, so a seeded run is reproducible)."""
        w = gaussian_orthogonal(self.m, self.head_dim, orthogonal=self.orthogonal)
        self.projection.copy_(w.to(self.projection))

    def forward(self, x: Tensor, step: Step, state: FavorState | None = None):
        """``x (B, T, C)`` -> ``(B, T, C)``; with ``state`` (causal), continue from its sums."""
        B, T, _ = x.shape
        if self.training and self.redraw_interval:
            if self.calls and self.calls % self.redraw_interval == 0:
                self.redraw()
            self.calls += 1
        q, k, v = self.project(x, step)
        k, v = self.expand(k), self.expand(v)                                # (B, nh, T, hs)
        qf = softmax_features(q, self.projection, is_query=True)            # (B, nh, T, m)
        kf = softmax_features(k, self.projection, is_query=False)           # (B, nh, T, m)
        keep = self.new_tokens(step, B, T)                                   # (B, T) real new tokens, or None
        if keep is not None:
            kf = kf * keep[:, None, :, None].to(kf.dtype)                   # padding adds nothing to the sums
        if not self.causal:
            return self.finish(favor_attention(qf, kf, v), step)
        # The sums depend only on the tokens seen, not on where they sit: eager and static steps
        # continue them alike (a fresh or reset state holds zeros).
        sums = None if state is None else (state.S, state.z)
        out, (S, z) = favor_causal(qf, kf, v, sums, chunk=self.chunk)       # (B, nh, T, hs)
        if state is not None:                  # in place: a row view of a larger state (the server's pool) writes through
            state.S.copy_(S)
            state.z.copy_(z)
        return self.finish(out, step)

    def new_state(self, batch_size: int, max_len: int, dtype=torch.float32, device=None) -> FavorState | None:
        if not self.causal:
            return None
        return FavorState(batch_size, self.n_heads, self.m, self.head_dim, dtype, device)

    @classmethod
    def extra_training_flops_per_token(cls, config: TransformerConfig, seq_len: int, layer: int = 0) -> int:
        """The matmuls of FAVOR+ no parameter counts, per token and head (``m`` features, ``e`` the
        head width), as multiply-adds: the features of q and k (``2·m·e``); bidirectional: ``φ(K)ᵀV``
        and ``φ(Q)·(φ(K)ᵀV)`` (``2·m·e``) and the normaliser (``m``); causal, by chunks of ``c``:
        the two running-sum products (``2·m·e``), the normaliser (``m``) and the within-chunk
        scores and sum (``c·(m + e)``). Times 2 FLOPs, 3 with the backward, ``nh`` heads."""
        m = cls.layer_option(config, "features", default_features(config.head_dim), layer)
        e = config.head_dim
        macs = 4 * m * e + m
        if config.causal:
            macs += min(cls.layer_option(config, "chunk", 64, layer), seq_len) * (m + e)
        return 6 * config.n_heads * macs

    @classmethod
    def state_bytes(cls, config: TransformerConfig, n_tokens: int, batch_size: int = 1,
                    bytes_per_element: int = 4) -> int:
        """``B·nh·(m·hs + m)`` elements, independent of ``n_tokens`` (kept in fp32 or wider)."""
        if not config.causal:
            return 0
        m = max(cls.int_option(config, "features", default_features(config.head_dim)))
        return batch_size * config.n_heads * (m * config.head_dim + m) * max(bytes_per_element, 4)

    @classmethod
    def check_config(cls, config: TransformerConfig) -> None:
        super().check_config(config)
        cls.int_option(config, "features", default_features(config.head_dim))
        cls.int_option(config, "redraw_interval", 1000, low=0)
        cls.int_option(config, "chunk", 64)
        if not isinstance(config.mixer_option(cls.name, "orthogonal", True), bool):
            raise ConfigError("mixer_options['performer']['orthogonal'] must be true or false.")
