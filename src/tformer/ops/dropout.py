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
    return ~drop_mask(shape, p, device, generator)


def drop_mask(shape: tuple[int, ...], p: float, device: torch.device | str = "cpu",
              generator: torch.Generator | None = None) -> Tensor:
    """``~keep_mask(shape, p)``, True = dropped: what the kernels use (one pass fewer than ``~keep``)."""
    numel = math.prod(shape)
    if keep_probability(p) == 0.0:                                   # the threshold 2¹⁶ fits no 16-bit word
        return torch.ones(shape, dtype=torch.bool, device=device)
    words = torch.randint(-2**63, 2**63 - 1, ((numel + 3) // 4,), dtype=torch.int64, device=device,
                          generator=generator)                       # 64 random bits per 4 entries
    bits = words.view(torch.int16)[:numel].view(shape)               # 16 bits per entry, read as signed
    threshold = round(p * 2**_BITS) - 2**(_BITS - 1)                 # unsigned u < t  <=>  u - 2¹⁵ < t - 2¹⁵
    return bits < threshold


class _DropoutAttention(torch.autograd.Function):
    """q ``(B, H, n, d)``, k ``(B, H, m, d)``, v ``(B, H, m, d_v)``; ``causal`` top-left aligned.

    Causal attention is computed in blocks of ``rows`` queries: rows ``s..e-1`` see keys ``0..e-1``
    only, so each block's scores are ``(rows, e)``, not ``(rows, m)``, and only its last
    ``(rows, rows)`` square needs the mask. Each row's softmax still sees all its keys, so this is
    exact (no online softmax); at n = m = 256 with 64-row blocks it touches 10/16 of the dense
    scores. The keep mask is drawn dense ``(B, H, n, m)`` in one call, as before, and each block
    reads its slice, so a seed gives the same draws whatever the block size. The rescaling
    ``c = 1/(1-p)`` is applied to the small ``(n, d_v)`` products instead of the ``(n, m)``
    weights: ``out = c·(W ⊙ keep)V``, ``dV = (W ⊙ keep)ᵀ(c·dO)``, ``dW = ((c·dO)Vᵀ) ⊙ keep``.
    """

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, p, rows):
        B, H, n, d = q.shape
        m, dv = k.shape[-2], v.shape[-1]
        compute = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        qs = torch.empty((B, H, n, d), dtype=q.dtype, device=q.device)
        torch.mul(q, scale, out=qs)                                            # q·scale, contiguous
        qs, k3, v3 = qs.view(B * H, n, d), k.reshape(B * H, m, d), v.reshape(B * H, m, dv)
        drop = drop_mask((B, H, n, m), p, q.device).view(B * H, n, m) if p > 0 else None
        kept = keep_probability(p)
        c = 1.0 / kept if kept > 0 else 0.0                                    # p = 1: everything dropped
        blocks = _blocks(n, m, causal, rows)
        saved, outs = [], []
        for s, e, keys in blocks:
            scores = torch.bmm(qs[:, s:e], k3[:, :keys].transpose(1, 2))         # (BH, e-s, keys)
            if causal and keys > s:                                            # the square on the diagonal
                scores[:, :, s:keys].masked_fill_(_upper(e - s, keys - s, q.device), float("-inf"))
            w = torch.softmax(scores, dim=-1, dtype=compute)                   # fp32 (fp64)
            blk = drop[:, s:e, :keys] if drop is not None else None
            if blk is None:
                a = w.to(q.dtype)
            elif q.dtype == w.dtype:
                a = w.masked_fill(blk, 0.0)                                    # W ⊙ keep
            else:
                a = w.to(q.dtype).masked_fill_(blk, 0.0)
            outs.append(torch.bmm(a, v3[:, :keys]))                            # (BH, e-s, d_v)
            saved += [w, a]
        out = (outs[0] if len(outs) == 1 else torch.cat(outs, 1)).mul_(c)
        ctx.save_for_backward(qs, k3, v3, drop, *saved)
        ctx.scale, ctx.c, ctx.blocks, ctx.shape = scale, c, blocks, (B, H, n, m, d, dv)
        return out.view(B, H, n, dv)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        qs, k3, v3, drop, *saved = ctx.saved_tensors
        B, H, n, m, d, dv_ = ctx.shape
        dout = (dout.to(qs.dtype).reshape(B * H, n, dv_) * ctx.c)               # c·dO: (BH, n, d_v)
        dk = torch.zeros_like(k3)
        dv = torch.zeros_like(v3)
        dqs = []
        for i, (s, e, keys) in enumerate(ctx.blocks):
            w, a = saved[2 * i], saved[2 * i + 1]
            do = dout[:, s:e]
            dv[:, :keys].baddbmm_(a.transpose(1, 2), do)                       # += (W ⊙ keep)ᵀ c·dO
            dw = torch.bmm(do, v3[:, :keys].transpose(1, 2)).to(w.dtype)       # c·dO Vᵀ: (BH, e-s, keys)
            if drop is not None:
                dw.masked_fill_(drop[:, s:e, :keys], 0.0)                      # dW = dA ⊙ keep · c
            ds = torch._softmax_backward_data(dw, w, -1, w.dtype).to(qs.dtype)  # W ⊙ (dW - rowsum(W ⊙ dW))
            dqs.append(torch.bmm(ds, k3[:, :keys]))                             # (BH, e-s, d)
            dk[:, :keys].baddbmm_(ds.transpose(1, 2), qs[:, s:e])               # += dSᵀ (Q·scale)
        dq = (dqs[0] if len(dqs) == 1 else torch.cat(dqs, 1)).mul_(ctx.scale)
        return dq.view(B, H, n, d), dk.view(B, H, m, d), dv.view(B, H, m, dv_), None, None, None, None


# Causal attention's query block (see _DropoutAttention): 64 rows measured fastest at (64, 6, 256, 64).
BLOCK_ROWS = 64


def _blocks(n: int, m: int, causal: bool, rows: int) -> list[tuple[int, int, int]]:
    """``(first row, end row, keys seen)`` per query block: causal (top-left) rows ``s..e-1`` see
    ``min(e, m)`` keys; without a causal mask one block of every row and key."""
    if not causal:
        return [(0, n, m)]
    return [(s, min(s + rows, n), min(s + rows, n, m)) for s in range(0, n, rows)]


def _upper(rows: int, cols: int, device) -> Tensor:
    """``(rows, cols)`` bool, True strictly above the diagonal: the keys after each query."""
    return torch.ones(rows, cols, dtype=torch.bool, device=device).triu_(1)


def dropout_attention(q: Tensor, k: Tensor, v: Tensor, *, p: float, scale: float, causal: bool = False,
                      block_rows: int = BLOCK_ROWS) -> Tensor:
    """``dropout(softmax(Q Kᵀ · scale [causal]), p) V`` with the weights dropped as described above.

    Causal is top-left aligned (query i sees keys 0..i), which is what callers use with ``n == m``;
    causal attention runs in blocks of ``block_rows`` queries (the result does not depend on it).
    """
    return _DropoutAttention.apply(q, k, v, causal, scale, p, block_rows)


class _Dropout(torch.autograd.Function):
    """``x ⊙ keep · c`` with ``keep`` drawn as in :func:`keep_mask`; backward ``g ⊙ keep · c``."""

    @staticmethod
    def forward(ctx, x, p):
        drop = drop_mask(tuple(x.shape), p, x.device)
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
