"""Longformer as a token mixer: sliding-window (optionally dilated) attention plus global tokens.

Options (``config.mixer_options["longformer"]``):

- ``window`` (default 256): keys on each side counting the token itself; an int, or a list with one
  value per layer (cycled over the stack), as the paper grows the window with depth.
- ``dilation`` (default 1): gap between window keys; int or per-layer list.
- ``global_positions`` (default ``[]``): positions whose tokens are global (e.g. ``[0]``, the
  classification token); global tokens get their own ``global_qkv_proj`` (paper §3.1).
- ``global_inputs`` (default ``False``): build ``global_qkv_proj`` even without ``global_positions``
  so that each call can name its global tokens (``global_attention_mask`` of the encoder's
  forward, :attr:`Step.global_tokens`: HF's way); they add to ``global_positions``'.

Causal generation keeps a ring buffer of the last ``(window - 1)·dilation`` keys and values per
layer (the new token is the window's last), so the state does not grow with the text
(:class:`RingState`). A causal model with global tokens is refused at ``new_state``: a global token
would need every key it ever saw.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tformer.ops.longformer import longformer_attention
from tformer.ops.masks import masked_softmax
from tformer.config import TransformerConfig
from tformer.errors import ConfigError, InputError
from tformer.mixers.base import Shared, Step
from tformer.mixers.projected import ProjectedAttention

Tensor = torch.Tensor


class RingState:
    """The last ``capacity`` keys/values of one layer, ``(B, nkv, capacity, hs)`` each, written at
    slot ``position % capacity``."""

    def __init__(self, batch_size: int, n_kv_heads: int, capacity: int, head_dim: int, dtype, device):
        shape = (batch_size, n_kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def read(self, start: int) -> tuple[Tensor, Tensor]:
        """Keys/values of positions ``max(0, start - capacity) .. start - 1`` in order: ``(B, nkv, L, hs)``."""
        slots = torch.arange(max(0, start - self.capacity), start, device=self.k.device) % max(self.capacity, 1)
        return self.k[:, :, slots], self.v[:, :, slots]

    def write(self, start: int, k: Tensor, v: Tensor) -> None:
        """Store the new ``k, v (B, nkv, T, hs)`` of positions ``start .. start + T - 1`` (the last
        ``capacity`` of them survive)."""
        T = k.shape[2]
        keep = min(T, self.capacity)
        if keep == 0:
            return
        slots = torch.arange(start + T - keep, start + T, device=k.device) % self.capacity
        self.k[:, :, slots] = k[:, :, T - keep:].to(self.k.dtype)
        self.v[:, :, slots] = v[:, :, T - keep:].to(self.v.dtype)


class LongformerAttention(ProjectedAttention):
    """Sliding-window + global attention (Beltagy et al., 2020); protocol of :mod:`tformer.mixers.base`."""

    name = "longformer"
    OPTIONS = ("window", "dilation", "global_positions", "global_inputs")

    def __init__(self, config: TransformerConfig, layer: int = 0, shared: Shared | None = None):
        super().__init__(config, layer, shared)
        self.window = self.option("window", 256)
        self.dilation = self.option("dilation", 1)
        self.global_positions = list(config.mixer_option(self.name, "global_positions", []))
        self.global_inputs = bool(config.mixer_option(self.name, "global_inputs", False))
        c = config
        if self.global_positions or self.global_inputs:
            width = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
            self.global_qkv_proj = nn.Linear(c.d_model, width, bias=c.qkv_bias)

    def global_mask(self, step: Step, batch: int, n: int) -> Tensor | None:
        """``(B, n)`` bool: which of the ``n`` tokens are global: real tokens whose position (the
        model's, ``step.positions``) is in ``global_positions``. A decoder counts positions over real
        tokens, so a left-padded row marks the same tokens as the row alone."""
        given = step.global_tokens
        if given is not None and not hasattr(self, "global_qkv_proj"):
            raise InputError("this Longformer has no global projections, so it takes no global_attention_mask; "
                             "build it with mixer_options['longformer']['global_inputs'] = True.")
        if not self.global_positions and given is None:
            return None
        mask = given
        if self.global_positions:
            pos = torch.broadcast_to(step.positions, (batch, n))                         # (B, n)
            fixed = torch.isin(pos, torch.tensor(self.global_positions, device=pos.device))  # (B, n)
            mask = fixed if mask is None else mask | fixed
        real = self.key_mask(step, batch, n)
        return mask if real is None else mask & real

    def forward(self, x: Tensor, step: Step, state: RingState | None = None):
        """``x (B, T, C)`` -> ``(B, T, C)``; with ``state``, ``x`` continues the text at ``step.start_pos``."""
        B, T, _ = x.shape
        q, k, v = self.project(x, step)                                      # (B, nh|nkv, T, hs)
        if state is not None:
            if step.global_tokens is not None:
                raise InputError("global_attention_mask is not supported while generating with a state.")
            attend = self._slot if step.slot is not None else self._cached
            return self.finish(attend(q, k, v, step, state), step)
        gmask = self.global_mask(step, B, T)
        gqkv = None
        if gmask is not None:
            gq, gk, gv = self.project(x, step, self.global_qkv_proj)
            gqkv = (gq, self.expand(gk), self.expand(gv))
        out = longformer_attention(q, self.expand(k), self.expand(v), self.window, causal=self.causal,
                                   dilation=self.dilation, key_mask=self.key_mask(step, B, T),
                                   global_mask=gmask, global_qkv=gqkv,   # a per-call mask: count read back
                                   max_global=len(self.global_positions) if step.global_tokens is None else None)
        return self.finish(out, step)

    def _cached(self, q: Tensor, k: Tensor, v: Tensor, step: Step, state: RingState) -> Tensor:
        """New tokens against the ring buffer plus themselves: O(T·w), whatever the position."""
        B, _, T, hs = q.shape
        s = step.start_pos
        old_k, old_v = state.read(s)                                         # (B, nkv, L, hs)
        L = old_k.shape[2]
        k_all, v_all = torch.cat([old_k, k], 2), torch.cat([old_v, v], 2)   # (B, nkv, L + T, hs)
        q_all = F.pad(q, (0, 0, L, 0))                                       # rows for the old keys: unused
        mask = self.key_mask(step, B, s + T)
        out = longformer_attention(q_all, self.expand(k_all), self.expand(v_all), self.window, causal=True,
                                   dilation=self.dilation,
                                   key_mask=None if mask is None else mask[:, s - L:])
        state.write(s, k, v)
        return out[:, :, L:]                                                 # (B, nh, T, hs)

    def _slot(self, q: Tensor, k: Tensor, v: Tensor, step: Step, state: RingState) -> Tensor:
        """Static decode (one token per row at index ``step.slot``): attend over the whole ring, each
        entry's validity computed from the slot as a tensor, then overwrite the oldest entry."""
        B, _, _, hs = q.shape
        slot, cap, d = step.slot, state.capacity, self.dilation
        entries = torch.arange(cap, device=q.device)
        held = slot[:, None] - 1 - torch.remainder(slot[:, None] - 1 - entries, max(cap, 1))  # (B, cap) positions
        dist = slot[:, None] - held
        ok = (held >= 0) & (dist % d == 0) & (dist < self.window * d)
        if step.mask is not None:
            real = self.key_mask(step, B, step.mask.shape[-1])                # (B, max_len)
            ok = ok & real.gather(1, held.clamp(min=0))
        ok = torch.cat([ok, torch.ones(B, 1, dtype=torch.bool, device=q.device)], 1)  # the new token itself
        keys = self.expand(torch.cat([state.k, k.to(state.k.dtype)], 2))     # (B, nh, cap + 1, hs)
        values = self.expand(torch.cat([state.v, v.to(state.v.dtype)], 2))
        scores = torch.matmul(q, keys.transpose(-1, -2)) * hs ** -0.5       # (B, nh, 1, cap + 1)
        out = torch.matmul(masked_softmax(scores, ok[:, None, None, :]), values)
        if cap:
            rows = torch.arange(B, device=q.device)
            state.k[rows, :, slot % cap] = k[:, :, 0].to(state.k.dtype)
            state.v[rows, :, slot % cap] = v[:, :, 0].to(state.v.dtype)
        return out                                                           # (B, nh, 1, hs)

    def new_state(self, batch_size: int, max_len: int, dtype=torch.float32, device=None) -> RingState | None:
        if not self.causal:
            return None
        if self.global_positions:
            raise ConfigError("a causal Longformer with global_positions cannot generate with a bounded state "
                              "(a global token attends to every earlier key); drop global_positions.")
        capacity = min((self.window - 1) * self.dilation, max_len)
        return RingState(batch_size, self.n_kv_heads, capacity, self.head_dim, dtype, device)

    @classmethod
    def count_parameters(cls, config: TransformerConfig) -> int:
        base = super().count_parameters(config)
        if not (config.mixer_option(cls.name, "global_positions", []) or config.mixer_option(cls.name, "global_inputs",
                                                                                              False)):
            return base
        c = config
        width = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
        return base + c.d_model * width + (width if c.qkv_bias else 0)

    @classmethod
    def extra_training_flops_per_token(cls, config: TransformerConfig, seq_len: int, layer: int = 0) -> int:
        """Scores and weighted sums as the kernel computes them, ``12 · nh · hs`` per key a query
        meets (PaLM's count for attention, with these keys for ``T``): each query block's key span
        ``L = 3w - 2`` (``2w - 1`` causal; dilation only spaces them), plus, with ``g`` global
        tokens, every query against the ``g`` global keys and the ``g`` global queries against all
        ``T`` keys (``g`` more per token)."""
        w = cls.layer_option(config, "window", 256, layer)
        span = 2 * w - 1 if config.causal else 3 * w - 2
        g = sum(1 for p in config.mixer_option(cls.name, "global_positions", []) if p < seq_len)
        return 12 * config.n_heads * config.head_dim * (span + 2 * g)

    @classmethod
    def state_bytes(cls, config: TransformerConfig, n_tokens: int, batch_size: int = 1,
                    bytes_per_element: int = 4) -> int:
        """Ring buffer bytes (the largest window of the stack): ``2·B·nkv·min(n, (w-1)·d)·hs``."""
        if not config.causal:
            return 0
        reach = max(w - 1 for w in cls.int_option(config, "window", 256)) * max(cls.int_option(config, "dilation", 1))
        return 2 * batch_size * config.n_kv_heads * min(n_tokens, reach) * config.head_dim * bytes_per_element

    @classmethod
    def check_config(cls, config: TransformerConfig) -> None:
        super().check_config(config)
        windows = cls.int_option(config, "window", 256)
        dilations = cls.int_option(config, "dilation", 1)
        reach = max((w - 1) * d + 1 for w in windows for d in dilations)
        if reach > config.context_length:
            raise ConfigError(f"Longformer window {max(windows)} (dilation {max(dilations)}) reaches {reach} tokens, "
                              f"more than context_length={config.context_length}; use a window <= the context "
                              f"(or plain attention).")
        gp = config.mixer_option(cls.name, "global_positions", [])
        if not isinstance(gp, (list, tuple)) or any(not isinstance(p, int) or not 0 <= p < config.context_length
                                                    for p in gp):
            raise ConfigError(f"mixer_options['longformer']['global_positions']={gp!r} must be a list of "
                              f"positions in [0, context_length={config.context_length}).")
        gi = config.mixer_option(cls.name, "global_inputs", False)
        if not isinstance(gi, bool):
            raise ConfigError(f"mixer_options['longformer']['global_inputs']={gi!r} must be true or false.")
