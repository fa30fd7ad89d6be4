"""Scaled dot-product attention, softmax(Q Kᵀ · scale + bias) V: the module path's one entry point for it.

Every attention module in tformer calls :func:`scaled_dot_product_attention`; the one other place
attention is computed is inside the whole-layer C++ call (:mod:`tformer.fused`, ``layers.cpp``),
which inference takes for the models it implements. The ``backend`` argument picks
*how* it is computed; the result is the same up to floating-point rounding (the tests hold them equal):

- ``"math"``: the formula written out; the only backend that can return the attention weights.
- ``"torch"``: ``torch.nn.functional.scaled_dot_product_attention`` (PyTorch's fused kernels).
- ``"flash"``: tformer's tiled kernel with O(n) memory (see ``ops/flash.py``).
- ``"auto"``: PyTorch's fused kernel when the request needs no dense ``(n, m)`` mask or bias, flash
  when it would (ALiBi, sliding window, causal with n < m or with key padding, at long lengths),
  math when weights are requested; :func:`choose_backend` says which and why.

Shapes: ``q (..., Hq, n, d_k)``, ``k (..., Hkv, m, d_k)``, ``v (..., Hkv, m, d_v)``; output
``(..., Hq, n, d_v)``. ``Hq`` must be a multiple of ``Hkv`` (grouped-query attention); K and V are
never repeated to ``Hq`` heads in memory. Masks are boolean, ``True`` = may attend; ``bias`` is
added to the scores. Both broadcast to ``(..., Hq, n, m)``. A query that may attend to no key gets
a zero output (never NaN).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from tformer.ops.checks import check_shapes as _check_shapes
from tformer.ops.dropout import dropout_attention
import tformer.ops.attention_cpu as attention_cpu
from tformer.ops.flash import flash_backend
from tformer.ops.masks import causal_mask, sliding_window_mask
from tformer.errors import InputError
from tformer.machine import emulates_half
from tformer.ops.alibi import alibi_bias

Tensor = torch.Tensor

# Extra backends register here; each has the signature of ``_math_attention`` minus
# ``return_weights``, plus the keyword ``alibi_slopes``.
EXTRA_BACKENDS: dict[str, Callable[..., Tensor]] = {"flash": flash_backend, "short": attention_cpu.short_attention}

# "auto" prefers flash over a dense mask/bias only from this many query-key pairs on (about
# n = m = 1448): between the lengths where the fused kernel with a dense mask measured faster and where
# flash did; below this the dense tensor is small anyway (figures: docs/flash-attention.md).
FLASH_MIN_PAIRS = 2**21


def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    causal: bool = False,
    window: int | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
    return_weights: bool = False,
    alibi_slopes: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention of ``n`` queries over ``m`` keys/values.

    Args:
        q: ``(..., Hq, n, d_k)`` queries (or ``(..., n, d_k)`` without a head dimension).
        k: ``(..., Hkv, m, d_k)`` keys; ``Hq % Hkv == 0``.
        v: ``(..., Hkv, m, d_v)`` values; ``d_v`` may differ from ``d_k``.
        mask: bool, ``True`` = attend; broadcastable to ``(..., Hq, n, m)``.
        bias: float added to the scores (ALiBi, relative positions); broadcastable likewise.
        causal: query ``i`` sees keys ``j <= i + m - n`` (bottom-right aligned).
        window: if set, query at position ``p`` sees only keys with ``|p - j| < window``.
        scale: multiplies ``Q Kᵀ``; default ``1 / sqrt(d_k)``.
        dropout_p: dropout on the attention weights (only pass > 0 in training).
        backend: ``"auto"``, ``"math"``, ``"torch"`` or a registered extra backend (``"flash"``).
        return_weights: also return the ``(..., Hq, n, m)`` attention weights (math backend).
        alibi_slopes: ``(Hq,)`` ALiBi slopes: adds ``-slope_h * |p_q - p_k|`` with the queries at
            key positions ``m - n .. m - 1`` (``tformer.ops.alibi.alibi_bias``). Flash computes it
            per block; math and torch build the dense ``(Hq, n, m)`` bias.

    Returns:
        ``out`` of shape ``(..., Hq, n, d_v)``, or ``(out, weights)`` if ``return_weights``.

    Raises:
        InputError: on inconsistent shapes, an unknown backend, or a request the backend cannot serve.
    """
    _check_shapes(q, k, v)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    name, _ = choose_backend(q, k, mask=mask, bias=bias, causal=causal, window=window, backend=backend,
                             return_weights=return_weights, alibi_slopes=alibi_slopes, dropout_p=dropout_p)
    if name == "short" and backend == "auto" and attention_cpu.serves(q, k, v, causal=causal) is not None:
        name = "torch"                                   # values of another width than the keys: not its case
    if alibi_slopes is not None and name not in EXTRA_BACKENDS:
        bias = _dense_alibi(alibi_slopes, q, k, bias)
    if name == "math":
        return _math_attention(q, k, v, mask, bias, causal, window, scale, dropout_p, return_weights)
    if return_weights:
        raise InputError(f"backend={backend!r} cannot return attention weights; use backend='math'.")
    if name == "torch":
        return _torch_attention(q, k, v, mask, bias, causal, window, scale, dropout_p)
    return EXTRA_BACKENDS[name](q, k, v, mask, bias, causal, window, scale, dropout_p, alibi_slopes=alibi_slopes)


def choose_backend(
    q: Tensor,
    k: Tensor,
    *,
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    causal: bool = False,
    window: int | None = None,
    backend: str = "auto",
    return_weights: bool = False,
    alibi_slopes: Tensor | None = None,
    dropout_p: float = 0.0,
) -> tuple[str, str]:
    """Which backend a call would use, and why (takes the same arguments as the call).

    ``"auto"`` picks math if weights are requested; else PyTorch's fused kernel if the request
    needs no dense ``(n, m)`` mask or bias; else (ALiBi, sliding window, causal with ``n < m``,
    causal plus a key-padding mask) flash once there are ``FLASH_MIN_PAIRS`` query-key pairs or
    more, and the fused kernel with a dense mask/bias below that. A dense mask or bias passed in by
    the caller already exists, so it goes to the fused kernel. Dropout excludes flash.

    Returns:
        ``(name, reason)``.
    """
    valid = ("auto", "math", "torch", *EXTRA_BACKENDS)
    if backend not in valid:
        raise InputError(f"unknown attention backend {backend!r}; choose one of {', '.join(valid)}.")
    if backend != "auto":
        return backend, "requested explicitly"
    if return_weights:
        return "math", "attention weights requested; only the math backend materialises them"
    n, m = q.shape[-2], k.shape[-2]
    dense_given = [name for name, t in (("mask", mask), ("bias", bias))
                   if t is not None and t.dim() >= 2 and t.shape[-2] > 1]
    if dense_given:
        return "torch", f"a dense (n, m) {' and '.join(dense_given)} was passed in; PyTorch's fused kernel takes it as is"
    needs = []
    if alibi_slopes is not None:
        needs.append("ALiBi bias")
    if window is not None:
        needs.append("sliding-window mask")
    if causal and 1 < n != m:
        needs.append(f"bottom-right causal mask (n={n} != m={m})")
    if causal and mask is not None and n > 1:
        needs.append("causal mask combined with key padding")
    if not needs:
        if _training(q, k) and attention_cpu.preferred(q, k, k, mask=mask, causal=causal, dropout_p=dropout_p):
            return "short", ("a training step over short sequences on the CPU: tformer's kernel, which holds a "
                             "head's whole score matrix in L1 (measured faster than PyTorch's here)")
        return "torch", "PyTorch's fused kernel serves this request without a dense (n, m) mask or bias"
    what = " and ".join(needs)
    if dropout_p > 0:
        return "torch", f"needs a dense {what}, but dropout_p={dropout_p} and flash has no dropout"
    if "flash" not in EXTRA_BACKENDS:
        return "torch", f"needs a dense {what}; flash is not registered"
    if n * m < FLASH_MIN_PAIRS:
        return "torch", (f"needs a dense {what}, but n*m={n * m} < FLASH_MIN_PAIRS={FLASH_MIN_PAIRS}: "
                         f"small enough that the fused kernel with a dense tensor is faster")
    return "flash", f"PyTorch's kernel would need a dense (n, m) {what}; flash computes it per block in O(n) memory"


# ---------------------------------------------------------------------------------------- helpers
def _training(q: Tensor, k: Tensor) -> bool:
    """Whether this call records a graph for a backward pass (a training step, not inference)."""
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)


def _allowed(
    q: Tensor, k: Tensor, mask: Tensor | None, causal: bool, window: int | None
) -> Tensor | None:
    """Combine the boolean mask, causal and window constraints into one mask, or None."""
    n, m = q.shape[-2], k.shape[-2]
    allowed = mask
    if mask is not None and mask.dtype != torch.bool:
        raise InputError(f"mask must be a bool tensor (True = attend), got {mask.dtype}; pass floats as bias=.")
    structural = None
    if window is not None:
        structural = sliding_window_mask(n, m, window, causal=causal, device=q.device)
    elif causal and not (n == 1 and m >= 1):  # a single last query sees every key
        structural = causal_mask(n, m, device=q.device)
    if structural is not None:
        allowed = structural if allowed is None else allowed & structural
    return allowed


def _group(t: Tensor | None, groups: int) -> Tensor | None:
    """(..., H, x, y) -> (..., H/groups, groups, x, y) so it broadcasts against grouped queries."""
    if t is None or t.dim() < 3:
        return t
    h = t.shape[-3]
    return t.unsqueeze(-3) if h == 1 else t.unflatten(-3, (h // groups, groups))


def safe_softmax(scores: Tensor) -> Tensor:
    """Softmax over the last dim that gives zeros (not NaN) for rows that are all ``-inf``."""
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    e = torch.exp(scores - row_max)
    total = e.sum(dim=-1, keepdim=True)
    return e / torch.where(total == 0, torch.ones_like(total), total)


def _dense_alibi(slopes: Tensor, q: Tensor, k: Tensor, bias: Tensor | None) -> Tensor:
    """The dense ``(Hq, n, m)`` ALiBi bias ``-slope_h * |p_q - p_k|`` (queries at key positions
    ``m - n .. m - 1``, as ``tformer.ops.alibi.alibi_bias``), plus ``bias``; fp64 stays fp64."""
    n, m = q.shape[-2], k.shape[-2]
    if q.dtype == torch.float64:
        slopes = slopes.double()
    dense = alibi_bias(slopes, torch.arange(m - n, m, device=q.device), torch.arange(m, device=q.device))  # (Hq, n, m)
    if q.dim() < 3 or k.dim() != q.dim():
        dense = dense.squeeze(0)  # no head dim: one slope
    return dense if bias is None else bias + dense


# --------------------------------------------------------------------------------------- backends
def _math_attention(q, k, v, mask, bias, causal, window, scale, dropout_p, return_weights):
    allowed = _allowed(q, k, mask, causal, window)
    groups = q.shape[-3] // k.shape[-3] if q.dim() >= 3 and k.dim() == q.dim() else 1
    if groups > 1:
        # GQA without repeating K/V: queries (..., Hkv, G, n, d) against keys (..., Hkv, 1, m, d).
        q, k, v = q.unflatten(-3, (k.shape[-3], groups)), k.unsqueeze(-3), v.unsqueeze(-3)
        allowed, bias = _group(allowed, groups), _group(bias, groups)
    compute = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    scores = (q @ k.transpose(-2, -1)).to(compute) * scale          # (..., n, m)
    if bias is not None:
        scores = scores + bias.to(compute)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    weights = safe_softmax(scores).to(q.dtype)                       # rows sum to 1 (0 if fully masked)
    attn = F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights
    out = attn @ v                                                  # (..., n, d_v)
    if groups > 1:
        out, weights = out.flatten(-4, -3), weights.flatten(-4, -3)
    return (out, weights) if return_weights else out


def _torch_attention(q, k, v, mask, bias, causal, window, scale, dropout_p):
    n, m = q.shape[-2], k.shape[-2]
    groups = q.shape[-3] // k.shape[-3] if q.dim() >= 3 and k.dim() == q.dim() else 1
    plain = mask is None and bias is None and window is None and (not causal or n == m)
    if q.device.type == "cpu" and dropout_p > 0 and plain and groups == 1 and q.dim() == 4:
        # PyTorch's CPU kernel has no dropout (it falls back to a slow math path): see ops/dropout.py
        return dropout_attention(q, k, v, p=dropout_p, scale=scale, causal=causal)
    training = q.requires_grad and torch.is_grad_enabled()
    if (training and q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16)) \
            or (n > 1 and emulates_half(q)):
        # 16-bit attention on a CPU runs on float32 copies, rounded back once, (a) in training: PyTorch 2.13's
        # CPU flash kernel is several times slower in bf16 than in fp32 once its backward counts
        # (docs/training.md#how-the-cpu-training-step-is-made-fast); a bf16 step that tformer's kernel takes
        # never gets here: choose_backend gives it "short", which reads and writes bf16 itself; and (b) for a
        # prompt where the CPU emulates the type, where PyTorch's 16-bit kernel measured slower than float32
        # copies (docs/inference.md#speed-against-llamacpp-and-hf-in-the-same-run). Decode steps keep the dtype.
        with torch.autocast("cpu", enabled=False):
            args = [t.float() for t in (q, k, v)]
            fbias = None if bias is None else bias.float()
            if training and attention_cpu.preferred(*args, mask=mask, bias=bias, causal=causal, window=window,
                                                    dropout_p=dropout_p):
                return attention_cpu.short_attention(*args, None, None, causal, None, scale, 0.0).to(q.dtype)
            return _torch_attention(*args, mask, fbias, causal, window, scale, dropout_p).to(q.dtype)
    # The fused kernel's own is_causal is top-left aligned: only use it when that is the same thing.
    if mask is None and bias is None and window is None and causal and n == m:
        if groups > 1:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True,
                                                  scale=scale, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale)

    allowed = _allowed(q, k, mask, causal, window)
    if bias is not None:
        finite = bias > float("-inf")
        allowed = finite if allowed is None else allowed & finite
    empty_rows = None
    if allowed is not None:
        # Rows with no visible key: let them see everything (no NaN, in forward or backward),
        # then zero their output, which is the defined result.
        empty_rows = ~allowed.any(dim=-1, keepdim=True)
        allowed = allowed | empty_rows
    attn_mask = allowed
    if bias is not None:
        attn_mask = bias.to(q.dtype).masked_fill(~allowed, float("-inf"))

    if groups > 1 and attn_mask is None and q.dim() >= 3:
        # Fold the query group into the sequence dim: (.., Hkv, G*n, d) attends to (.., Hkv, m, d).
        qf = q.unflatten(-3, (k.shape[-3], groups)).flatten(-3, -2)
        out = F.scaled_dot_product_attention(qf, k, v, dropout_p=dropout_p, scale=scale)
        return out.unflatten(-2, (groups, n)).flatten(-4, -3)
    kwargs = {"enable_gqa": True} if groups > 1 else {}
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                         scale=scale, **kwargs)
    if empty_rows is not None:
        out = out.masked_fill(empty_rows, 0.0)
    return out
