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
- ``longrope`` (Phi-3 / 3.5, Ding et al. 2024): two searched sets of divisors, ``ω_i / short_factor[i]`` for a
  context of at most ``L`` = ``original_max_position_embeddings`` and ``ω_i / long_factor[i]`` beyond it; cos and
  sin times ``attention_factor``, default ``sqrt(1 + ln s / ln L)`` with ``s = factor``, default
  ``context_length / L`` (Phi-3.5-mini: 131072 / 4096 = 32, so 1.190), applied with either set.

Which set, i.e. what "the context" is, differs between the two references:

- transformers (``modeling_rope_utils.dynamic_rope_update``) decides at every forward call from
  ``max(position_ids) + 1``: a call reaching past ``L`` rotates *all* its tokens with the long set. Its cached
  generation keeps the keys it rotated with the short set while the sequence was short and rotates the later
  ones with the long set, so past ``L`` its cached decoding is not its own recomputation.
- llama.cpp (``llama_model::get_rope_factors``) decides once per context, from the context size it was created
  with (``n_ctx`` per sequence ``> L``: long), whatever the positions.

tformer follows transformers for a call without an inference state (the set of ``max position + 1``, so its
logits equal transformers' on every prompt) and llama.cpp within an inference state: the state's ``context``
(the ``max_len`` it was made with, kept by its views of fewer keys) picks the set for every token written to it, so cached decoding
is exactly the recomputation of a prompt of that context, and a state longer than ``L`` uses the long set from
its first token as llama.cpp with a larger ``n_ctx`` does (``generate`` makes its state prompt + new tokens
long; a server's pool spans ``max_model_len``, also when a step decodes through a view of fewer keys). :meth:`tformer.nn.positions.RotaryEmbedding.ensure` switches.

Everything is computed in float64 (the tables are rounded to float32 once, after the angles).
"""

from __future__ import annotations

import math

import torch

Tensor = torch.Tensor


def plain_frequencies(head_dim: int, base: float) -> Tensor:
    """``ω_i = base^(-2i/hs)`` for ``i < hs/2``: ``(hs/2,)`` float64."""
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))


def frequencies(head_dim: int, base: float, scaling: dict | None = None, context_length: int | None = None,
                long: bool = False) -> tuple[Tensor, float]:
    """The ``(hs/2,)`` float64 frequencies and the factor on cos and sin, for ``scaling`` (``None``: plain);
    ``long`` picks LongRoPE's set for a context past the original one, ``context_length`` its default factor."""
    inv_freq = plain_frequencies(head_dim, base)
    if scaling is None:
        return inv_freq, 1.0
    kind, s = scaling["rope_type"], scaling.get("factor", 1.0)
    if kind == "linear":
        return inv_freq / s, 1.0
    if kind == "factors":
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float64), 1.0
    if kind == "longrope":
        return longrope(inv_freq, scaling, context_length, long)
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


def longrope(inv_freq: Tensor, scaling: dict, context_length: int | None, long: bool) -> tuple[Tensor, float]:
    """LongRoPE's short or long frequencies and its attention factor (see the module docstring)."""
    original = scaling["original_max_position_embeddings"]
    divisors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float64)   # (hs/2,)
    s = scaling.get("factor") or (context_length / original if context_length else 1.0)
    factor = scaling.get("attention_factor")
    if factor is None:
        factor = math.sqrt(1 + math.log(s) / math.log(original)) if s > 1 else 1.0
    return inv_freq / divisors, float(factor)
