"""BigBird as a token mixer: block-sparse bidirectional attention (an encoder layer).

Options (``config.mixer_options["bigbird"]``):

- ``block_size`` (default 64): must divide ``context_length``; shorter inputs are padded to whole
  blocks with masked keys (as ``transformers`` does).
- ``num_random_blocks`` (default 3): random key blocks per query block.
- ``seed`` (default 0): the random pattern of layer ``i`` comes from ``seed + i``, the same on every run.
- ``random`` (default ``"seeded"``): ``"first"`` reproduces ``transformers``' eval mode (every random
  block is block 0), used by converted HF checkpoints.

Sequences of ``n <= (5 + 2r)·b`` tokens run dense attention (the pattern would cover nearly every
key anyway); the mixer warns once with the reason and keeps it in ``last_path``.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from tformer.ops.bigbird import bigbird_attention, dense_reason, random_blocks
from tformer.ops.masks import masked_softmax
from tformer.config import TransformerConfig
from tformer.errors import ConfigError
from tformer.mixers.base import Shared, Step
from tformer.mixers.projected import ProjectedAttention

Tensor = torch.Tensor


class BigBirdAttention(ProjectedAttention):
    """Window + global + random block attention (Zaheer et al., 2020); protocol of :mod:`tformer.mixers.base`."""

    name = "bigbird"
    OPTIONS = ("block_size", "num_random_blocks", "seed", "random")

    def __init__(self, config: TransformerConfig, layer: int = 0, shared: Shared | None = None):
        super().__init__(config, layer, shared)
        self.block = self.option("block_size", 64)
        self.n_random = self.option("num_random_blocks", 3)
        self.seed = self.option("seed", 0) + layer
        self.random_mode = self.option("random", "seeded")
        self.last_path: tuple[str, str | None] = ("", None)
        self._tables: dict[int, Tensor] = {}

    def table(self, n_blocks: int) -> Tensor:
        """This layer's ``(nh, nb, r)`` random key blocks for ``nb`` blocks (drawn once, then cached)."""
        if n_blocks not in self._tables:
            self._tables[n_blocks] = random_blocks(n_blocks, self.n_random, self.n_heads, self.seed, self.random_mode)
        return self._tables[n_blocks]

    def forward(self, x: Tensor, step: Step, state=None):
        """``x (B, T, C)`` -> ``(B, T, C)``."""
        B, T, _ = x.shape
        q, k, v = self.project(x, step)
        k, v = self.expand(k), self.expand(v)                                # (B, nh, T, hs)
        mask = self.key_mask(step, B, T)
        pad = (-T) % self.block
        n = T + pad
        reason = dense_reason(n, self.block, self.n_random)
        if reason is not None:
            if self.last_path[0] != "dense":
                warnings.warn(f"BigBird layer {self.layer}: {reason}.", stacklevel=2)
            self.last_path = ("dense", reason)
            ok = torch.ones(B, 1, 1, T, dtype=torch.bool, device=x.device) if mask is None else mask[:, None, None]
            s = torch.matmul(q, k.transpose(-1, -2)) * self.head_dim ** -0.5  # (B, nh, T, T)
            return self.finish(torch.matmul(masked_softmax(s, ok), v), step)
        self.last_path = ("block-sparse", None)
        if pad:
            q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
            keep = torch.ones(B, T, dtype=torch.bool, device=x.device) if mask is None else mask
            mask = F.pad(keep, (0, pad), value=False)
        out = bigbird_attention(q, k, v, self.block, self.table(n // self.block).to(x.device), key_mask=mask)
        return self.finish(out[:, :, :T], step)

    @classmethod
    def extra_training_flops_per_token(cls, config: TransformerConfig, seq_len: int, layer: int = 0) -> int:
        """``12 · nh · hs`` per query-key pair the layer computes, per token: with ``n`` = ``T``
        padded to whole blocks, the ``nb - 2`` middle query blocks meet ``(5 + r)·b`` keys each and
        the two global blocks all ``n``; dense (``T`` keys per query) where the forward falls back
        to dense attention (:func:`~tformer.ops.bigbird.dense_reason`)."""
        b = cls.layer_option(config, "block_size", 64, layer)
        r = cls.layer_option(config, "num_random_blocks", 3, layer)
        n = -(-seq_len // b) * b
        if dense_reason(n, b, r) is not None:
            pairs = seq_len * seq_len
        else:
            pairs = (n - 2 * b) * (5 + r) * b + 2 * b * n
        return 12 * config.n_heads * config.head_dim * pairs // seq_len

    @classmethod
    def check_config(cls, config: TransformerConfig) -> None:
        super().check_config(config)
        if config.causal:
            raise ConfigError("mixer='bigbird' is bidirectional (its global and random blocks see future tokens); "
                              "use it with causal=False, or choose longformer or performer for a decoder.")
        for block in cls.int_option(config, "block_size", 64):
            if config.context_length % block:
                    raise ConfigError(f"BigBird block_size={block} does not divide context_length="
                                  f"{config.context_length}; choose a block size that divides it.")
        cls.int_option(config, "num_random_blocks", 3, low=0)
        cls.int_option(config, "seed", 0, low=0)
        if config.mixer_option(cls.name, "random", "seeded") not in ("seeded", "first"):
            raise ConfigError("mixer_options['bigbird']['random'] must be 'seeded' or 'first'.")
