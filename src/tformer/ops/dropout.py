"""Attention with dropout on its weights, on the CPU, at a fraction of the cost of the generic path.

    scores = Q Kᵀ · scale (masked: -inf)                  (B, H, n, m)
    W      = softmax(scores)                              rows sum to 1
    A      = W ⊙ keep / (1 - p)                           keep ~ Bernoulli(1 - p), i.i.d. per entry
    out    = A V                                          (B, H, n, d_v)

This is what nanoGPT's attention does in training (``dropout_p`` passed to PyTorch's SDPA). On the CPU
PyTorch's fused kernel has no dropout, so SDPA falls back to its math path, whose ``bernoulli_``
draws a float per score from a serial Mersenne Twister and whose dropout costs three more passes.
Here the Bernoulli draws come from 16 random bits per entry: one 64-bit ``randint`` gives four
entries, and ``keep = bits >= t`` with ``t = round(p · 2¹⁶)`` (bits read as unsigned), so the drop
probability is ``p`` rounded to a multiple of 2⁻¹⁶ (0.2 → 0.199997) and the kept weights are
scaled by the exact inverse of the keep probability, so ``E[A] = W`` exactly. Draws use torch's
default generator, so ``torch.manual_seed`` makes a run repeatable.

Backward, with ``c = 1 / (1 - p_eff)`` and the saved ``W`` and ``keep``:

    dV = Aᵀ dO,   dA = dO Vᵀ,   dW = dA ⊙ keep · c,
    dS = W ⊙ (dW - rowsum(W ⊙ dW))   (softmax backward),   dQ = dS K · scale,   dK = dSᵀ Q · scale.

Matmuls run in the input dtype (bf16 under autocast: AMX/AVX-512-BF16), softmax and its backward in
fp32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

Tensor = torch.Tensor
_BITS = 16


def keep_probability(p: float) -> float:
    """The keep probability actually drawn for drop probability ``p``: ``1 - round(p·2¹⁶)/2¹⁶``."""
    return 1.0 - round(p * 2**_BITS) / 2**_BITS


def keep_mask(shape: tuple[int, ...], p: float, device: torch.device | str = "cpu",
              generator: torch.Generator | None = None) -> Tensor:
    """Bool ``shape``, True with probability :func:`keep_probability` (p), independently per entry."""
    numel = math.prod(shape)
    if keep_probability(p) == 0.0:                                   # the threshold 2¹⁶ fits no 16-bit word
        return torch.zeros(shape, dtype=torch.bool, device=device)
    words = torch.randint(-2**63, 2**63 - 1, ((numel + 3) // 4,), dtype=torch.int64, device=device,
                          generator=generator)                       # 64 random bits per 4 entries
    bits = words.view(torch.int16)[:numel].view(shape)               # 16 bits per entry, read as signed
    threshold = round(p * 2**_BITS) - 2**(_BITS - 1)                 # unsigned u >= t  <=>  u - 2¹⁵ >= t - 2¹⁵
    return bits >= threshold


class _DropoutAttention(torch.autograd.Function):
    """q ``(B, H, n, d)``, k ``(B, H, m, d)``, v ``(B, H, m, d_v)``; ``blocked`` (n, m) bool or None."""

    @staticmethod
    def forward(ctx, q, k, v, blocked, scale, p):
        compute = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        scores = torch.matmul(q * scale, k.transpose(-1, -2))                  # (B, H, n, m), in q's dtype
        if blocked is not None:
            scores.masked_fill_(blocked, float("-inf"))
        w = torch.softmax(scores, dim=-1, dtype=compute)                       # (B, H, n, m), fp32 (fp64)
        drop = ~keep_mask(tuple(w.shape), p, w.device) if p > 0 else None
        kept = keep_probability(p)
        c = 1.0 / kept if kept > 0 else 0.0                                    # p = 1: everything dropped
        a = w.to(q.dtype).mul_(c) if q.dtype != w.dtype else w * c             # rescaled weights
        if drop is not None:
            a.masked_fill_(drop, 0.0)                                          # A = W ⊙ keep · c
        out = torch.matmul(a, v)                                               # (B, H, n, d_v)
        ctx.save_for_backward(q, k, v, w, drop, a)
        ctx.scale, ctx.c = scale, c
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, w, drop, a = ctx.saved_tensors
        dout = dout.to(q.dtype)
        dv = torch.matmul(a.transpose(-1, -2), dout)                           # Aᵀ dO: (B, H, m, d_v)
        dw = torch.matmul(dout, v.transpose(-1, -2)).to(w.dtype).mul_(ctx.c)  # dO Vᵀ · c: (B, H, n, m)
        if drop is not None:
            dw.masked_fill_(drop, 0.0)                                         # dW = dA ⊙ keep · c
        ds = torch._softmax_backward_data(dw, w, -1, w.dtype).to(q.dtype)    # W ⊙ (dW - rowsum(W ⊙ dW))
        dq = torch.matmul(ds, k).mul_(ctx.scale)                               # (B, H, n, d)
        dk = torch.matmul(ds.transpose(-1, -2), q).mul_(ctx.scale)             # (B, H, m, d)
        return dq, dk, dv, None, None, None


def dropout_attention(q: Tensor, k: Tensor, v: Tensor, *, p: float, scale: float, causal: bool = False) -> Tensor:
    """``dropout(softmax(Q Kᵀ · scale [causal]), p) V`` with the weights dropped as described above.

    Causal is top-left aligned (query i sees keys 0..i), which is what callers use with ``n == m``.
    """
    n, m = q.shape[-2], k.shape[-2]
    blocked = torch.ones(n, m, dtype=torch.bool, device=q.device).triu_(1) if causal else None
    return _DropoutAttention.apply(q, k, v, blocked, scale, p)


class _Dropout(torch.autograd.Function):
    """``x ⊙ keep · c`` with ``keep`` drawn as in :func:`keep_mask`; backward ``g ⊙ keep · c``."""

    @staticmethod
    def forward(ctx, x, p):
        drop = ~keep_mask(tuple(x.shape), p, x.device)
        kept = keep_probability(p)
        ctx.c = 1.0 / kept if kept > 0 else 0.0
        ctx.save_for_backward(drop)
        return (x * ctx.c).masked_fill_(drop, 0.0)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        (drop,) = ctx.saved_tensors
        return (g * ctx.c).masked_fill_(drop, 0.0), None


def dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    """``F.dropout(x, p, training)`` with the 16-bit Bernoulli draws of :func:`keep_mask` on the CPU
    (PyTorch's CPU ``bernoulli_`` draws a float per element; this is about 2x cheaper per element);
    on other devices, and when nothing is dropped, ``F.dropout`` itself."""
    if not training or p == 0 or x.device.type != "cpu":
        return F.dropout(x, p, training)
    return _Dropout.apply(x, p)
