"""Attention written out with its intermediate tensors exposed: the scores and the pattern.

    scores  = Q Kᵀ · scale + bias [soft-capped], masked with -inf where a key may not be seen   (B, nh, n, m)
    pattern = softmax(scores) over the keys                                       (B, nh, n, m)
    out     = pattern V                                                           (B, nh, n, hs)

The same maths as the math backend of :func:`tformer.ops.sdpa.scaled_dot_product_attention` (its
mask and ALiBi rules are reused, not re-derived), but the two intermediates pass through callbacks
that may replace them: interpretability reads and patches them (``tformer.interp``). Grouped-query
keys and values are repeated to ``nh`` heads first (head ``h`` reads key/value head
``h // (nh / nkv)``), so the pattern has one map per query head. Hooked runs take this path, and
so does soft-capped attention (Gemma 2), whose cap no fused kernel applies.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from tformer.ops.sdpa import _allowed, _dense_alibi, safe_softmax

Tensor = torch.Tensor
Hook = Callable[[Tensor], Tensor]


def repeat_kv(t: Tensor, n_heads: int) -> Tensor:
    """``(B, nkv, m, hs)`` -> ``(B, n_heads, m, hs)``: each key/value head serves ``n_heads / nkv`` query heads."""
    return t.repeat_interleave(n_heads // t.shape[1], dim=1) if t.shape[1] != n_heads else t


def explicit_attention(q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None = None, bias: Tensor | None = None,
                       causal: bool = False, window: int | None = None, alibi_slopes: Tensor | None = None,
                       scale: float | None = None, softcap: float = 0.0, on_scores: Hook | None = None,
                       on_pattern: Hook | None = None, backend: str | None = None) -> Tensor:
    """``q (B, nh, n, hs)``, ``k, v (B, nkv, m, hs)`` -> ``(B, nh, n, hs)``, queries at key positions
    ``m - n .. m - 1``; ``mask``/``bias``/``causal``/``window``/``alibi_slopes`` as in
    :func:`~tformer.ops.sdpa.scaled_dot_product_attention` (``backend`` is accepted and ignored, so
    a KV cache's ``attention_arguments`` pass straight through); ``softcap > 0`` maps the scores to
    ``softcap · tanh(s / softcap)`` before the mask (Gemma 2's attention soft-cap). ``on_scores`` / ``on_pattern`` see
    the ``(B, nh, n, m)`` masked scores and the softmax and may return replacements."""
    nh = q.shape[1]
    k, v = repeat_kv(k, nh), repeat_kv(v, nh)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if alibi_slopes is not None:
        bias = _dense_alibi(alibi_slopes, q, k, bias)
    compute = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    scores = (q @ k.transpose(-2, -1)).to(compute) * scale                       # (B, nh, n, m)
    if bias is not None:
        scores = scores + bias.to(compute)
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)                          # before the mask, as Gemma 2
    allowed = _allowed(q, k, mask, causal, window)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    if on_scores is not None:
        scores = on_scores(scores)
    pattern = safe_softmax(scores)                                              # rows sum to 1
    if on_pattern is not None:
        pattern = on_pattern(pattern)
    return pattern.to(v.dtype) @ v                                              # (B, nh, n, hs)
