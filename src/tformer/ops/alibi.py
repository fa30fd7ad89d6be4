"""ALiBi (Press et al., 2022): no position embedding at all, a fixed penalty on attention scores that
grows with distance, ``score(q, k) - slope_h · |p_q - p_k|``, with one slope per head.

Heads with small slopes look far, heads with large slopes look near; because nothing is learned per
position, the bias is defined at every length, which is why ALiBi extrapolates past the training
context. The slopes are a fixed geometric sequence, so this is kernel maths, not a module.
"""

from __future__ import annotations

import math

import torch

Tensor = torch.Tensor


def alibi_slopes(n_heads: int) -> Tensor:
    """Press et al.'s head slopes: the geometric sequence 2^(-8/n), 2^(-16/n), ... for n a power
    of two; otherwise the slopes of the next lower power of two, then every other slope of the
    next higher power of two (the paper's recipe, as in BLOOM).
    """

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(n_heads).is_integer():
        slopes = power_of_two(n_heads)
    else:
        lower = 2 ** math.floor(math.log2(n_heads))
        slopes = power_of_two(lower) + power_of_two(2 * lower)[0::2][: n_heads - lower]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi_bias(slopes: Tensor, q_positions: Tensor, k_positions: Tensor) -> Tensor:
    """ALiBi score bias ``-slope_h * |p_q - p_k|``.

    Args:
        slopes: ``(H,)``; q_positions: ``(n,)``; k_positions: ``(m,)``.
    Returns:
        ``(H, n, m)`` bias, float64 if the slopes are float64, else float32. (Under a causal mask only ``p_k <= p_q`` matters, where this is
        the paper's ``slope * (p_k - p_q)``; the absolute value makes it usable bidirectionally.)
    """
    dtype = torch.float64 if slopes.dtype == torch.float64 else torch.float32
    distance = (q_positions[:, None] - k_positions[None, :]).abs().to(dtype)  # (n, m)
    return -slopes[:, None, None].to(dtype) * distance
