"""Where a token is: the four position schemes, each applied where it acts.

- ``learned`` and ``sinusoidal`` produce a vector that is *added to the token embedding*.
- ``rope`` *rotates* q and k inside attention (Su et al., 2021), so q·k depends on p - r only.
- ``alibi`` adds ``-slope_h * |p - r|`` to the attention *scores* (Press et al., 2022).

Every scheme takes absolute positions (an offset, or a ``(B, T)`` tensor of them), so that cached
decoding and left-padded batches see exactly the positions a full recomputation would.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from tformer.nn.rope_scaling import frequencies
from tformer.ops import attention_cpu

Tensor = torch.Tensor


def sinusoidal_table(length: int, d_model: int, base: float = 10000.0) -> Tensor:
    """Vaswani et al.: PE(p, 2i) = sin(p / base^(2i/d)), PE(p, 2i+1) = cos(p / base^(2i/d)).

    Returns:
        ``(length, d_model)`` float32 table.
    """
    pos = torch.arange(length, dtype=torch.float64).unsqueeze(1)               # (L, 1)
    inv_freq = base ** (-torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)  # (d/2,)
    angles = pos * inv_freq                                                    # (L, d/2)
    table = torch.empty(length, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angles)
    table[:, 1::2] = torch.cos(angles)
    return table.float()


class SinusoidalPositions(nn.Module):
    """Fixed sinusoidal vectors, added to the embedding. No parameters."""

    def __init__(self, context_length: int, d_model: int):
        super().__init__()
        self.register_buffer("table", sinusoidal_table(context_length, d_model), persistent=False)

    def forward(self, positions: Tensor) -> Tensor:
        """positions ``(T,)`` or ``(B, T)`` -> ``(T, C)`` or ``(B, T, C)``."""
        return self.table[positions]


class LearnedPositions(nn.Module):
    """One trained vector per position (GPT-2, BERT), added to the embedding."""

    def __init__(self, context_length: int, d_model: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(context_length, d_model))

    def forward(self, positions: Tensor) -> Tensor:
        return self.weight[positions]


class RotaryEmbedding(nn.Module):
    """RoPE: rotate each pair (x_i, x_{i + hs/2}) of q and k by angle p · base^(-2i/hs).

    The pairing is the "rotate half" layout used by GPT-NeoX and Llama in HuggingFace, so their
    weights load without permutation. Tables are precomputed to ``context_length`` or
    :data:`FIRST_ROWS`, whichever is smaller (a file's ``context_length = 2**40`` must not allocate
    terabytes at construction); the model calls :meth:`ensure` with a Python int before every input,
    which grows them to the length used, so ``forward`` never has to look at the values of
    ``positions`` (no host synchronisation, nothing for ``torch.compile`` to break on).
    """

    FIRST_ROWS = 4096

    def __init__(self, head_dim: int, context_length: int, base: float = 10000.0, scaling: dict | None = None):
        super().__init__()
        self.head_dim, self.base = head_dim, base
        # A plain attribute, not a buffer: model.to(bfloat16) must not round the frequencies. A scaled RoPE
        # (tformer.nn.rope_scaling) changes them, and YaRN multiplies the tables by its attention factor.
        self.inv_freq, self.attention_factor = frequencies(head_dim, base, scaling, context_length)
        # LongRoPE: (short set, long set, original context); ensure() switches by the context in use
        self.longrope = (self.inv_freq, frequencies(head_dim, base, scaling, context_length, long=True)[0],
                         scaling["original_max_position_embeddings"]) \
            if scaling is not None and scaling["rope_type"] == "longrope" else None
        self._build(max(1, min(context_length, self.FIRST_ROWS)))

    def _build(self, length: int) -> None:
        angles = torch.arange(length, dtype=torch.float64).unsqueeze(1) * self.inv_freq  # (L, hs/2)
        angles = torch.cat([angles, angles], dim=-1)                                      # (L, hs)
        self.register_buffer("cos", (angles.cos() * self.attention_factor).float(), persistent=False)
        self.register_buffer("sin", (angles.sin() * self.attention_factor).float(), persistent=False)

    def ensure(self, length: int, context: int | None = None) -> None:
        """Extend the tables so positions ``< length`` can be looked up; a LongRoPE picks its set for
        ``context`` (default ``length``): long past the original context (:mod:`tformer.nn.rope_scaling`)."""
        if self.longrope is not None:
            short, long, original = self.longrope
            want = long if (context or length) > original else short
            if want is not self.inv_freq:
                self.inv_freq = want
                self._rebuild(max(self.cos.shape[0], length))
                return
        if length > self.cos.shape[0]:
            self._rebuild(max(2 * self.cos.shape[0], length))

    def _rebuild(self, length: int) -> None:
        """New tables of ``length`` rows on the old ones' device and dtype."""
        device, dtype = self.cos.device, self.cos.dtype
        self._build(length)
        self.cos, self.sin = self.cos.to(device, dtype), self.sin.to(device, dtype)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        """Rotate ``x (B, nh, T, hs)`` by ``positions`` ``(T,)`` or ``(B, T)`` (all below the table length)."""
        cos, sin = self.cos[positions], self.sin[positions]                 # (T, hs) or (B, T, hs)
        if attention_cpu.rotates(x, cos):                                   # a training step on the CPU:
            return attention_cpu.rotate(x, cos, sin)                        # one pass each way, not eight ops
        if cos.dim() == 3:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)                   # (B, 1, T, hs)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)        # rotate_half(x)
        return x * cos + rotated * sin


def table_length(module: nn.Module) -> int:
    """Rows of a learned or sinusoidal table."""
    return (module.weight if isinstance(module, LearnedPositions) else module.table).shape[0]
