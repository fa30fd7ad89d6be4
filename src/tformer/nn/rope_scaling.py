"""RoPE's frequencies, plain or scaled for a context longer than the one a model was trained at.

Plain RoPE turns pair ``i`` of a head (``hs`` wide) at ``ω_i = base^(-2i/hs)`` radians per position. A
scaling divides some frequencies by up to ``s = factor``, so a slow pair's angle at position ``s·L`` is
the one it had at ``L``, the longest context seen in training (``config.rope_scaling``, keyed as
transformers' ``rope_parameters``; :data:`tformer.config.ROPE_SCALINGS` lists the keys):

- ``linear`` (Chen et al. 2023, position interpolation): every ``ω_i / s``.
- ``llama3`` (Llama 3.1): with wavelength ``λ_i = 2π/ω_i`` and ``L`` = ``original_max_position_embeddings``,
  ``ω_i`` is kept where ``λ_i < L / high_freq_factor`` (fast pairs), divided by ``s`` where
  ``λ_i > L / low_freq_factor`` (slow pairs), and between them ``(1 - t)·ω_i/s + t·ω_i`` with
  ``t = (L/λ_i - low) / (high - low)``.
- ``yarn`` (Peng et al. 2023): the pairs that turn more than ``beta_fast`` times within ``L`` are kept, those
  turning fewer than ``beta_slow`` times are divided by ``s``; pair ``i`` of dimension
  ``d(r) = hs·ln(L / (2π r)) / (2 ln base)`` rotations ``r`` ramps linearly between (the bounds rounded
  outwards when ``truncate``, as transformers and llama.cpp do). Each cos and sin is also multiplied by
  ``attention_factor`` (default ``0.1·ln s + 1``), which scales every score q·k by its square.
- ``factors``: ``ω_i / factors[i]``, the divisors a GGUF file stores as ``rope_freqs.weight``.

Everything is computed in float64 (the tables are rounded to float32 once, after the angles).
"""

from __future__ import annotations

import math

import torch

Tensor = torch.Tensor


def plain_frequencies(head_dim: int, base: float) -> Tensor:
    """``ω_i = base^(-2i/hs)`` for ``i < hs/2``: ``(hs/2,)`` float64."""
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))


def frequencies(head_dim: int, base: float, scaling: dict | None = None) -> tuple[Tensor, float]:
    """The ``(hs/2,)`` float64 frequencies and the factor on cos and sin, for ``scaling`` (``None``: plain)."""
    inv_freq = plain_frequencies(head_dim, base)
    if scaling is None:
        return inv_freq, 1.0
    kind, s = scaling["rope_type"], scaling.get("factor", 1.0)
    if kind == "linear":
        return inv_freq / s, 1.0
    if kind == "factors":
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float64), 1.0
    if kind == "llama3":
        return llama3(inv_freq, s, scaling["low_freq_factor"], scaling["high_freq_factor"],
                      scaling["original_max_position_embeddings"]), 1.0
    return yarn(inv_freq, head_dim, base, scaling)


def llama3(inv_freq: Tensor, s: float, low: float, high: float, original: int) -> Tensor:
    """Llama 3.1's per-frequency scaling (see the module docstring)."""
    wavelength = 2 * math.pi / inv_freq
    t = (original / wavelength - low) / (high - low)                          # 0 at λ = L/low, 1 at λ = L/high
    smooth = (1 - t) * inv_freq / s + t * inv_freq
    out = torch.where(wavelength > original / low, inv_freq / s, inv_freq)
    return torch.where((wavelength >= original / high) & (wavelength <= original / low), smooth, out)


def yarn(inv_freq: Tensor, head_dim: int, base: float, scaling: dict) -> tuple[Tensor, float]:
    """YaRN's frequencies and attention factor (see the module docstring)."""
    s, original = scaling["factor"], scaling["original_max_position_embeddings"]

    def dimension(rotations: float) -> float:                 # the pair index that turns `rotations` times in L
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension(scaling.get("beta_fast", 32.0)), dimension(scaling.get("beta_slow", 1.0))
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / max(high - low, 0.001)).clamp(0, 1)
    inv_freq = inv_freq / s * ramp + inv_freq * (1 - ramp)    # ramp 0: kept (fast pairs), 1: divided by s
    factor = scaling.get("attention_factor")
    return inv_freq, float(factor if factor is not None else (0.1 * math.log(s) + 1.0 if s > 1 else 1.0))
