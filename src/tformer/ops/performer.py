"""Performer attention, FAVOR+ (Choromanski et al., 2021): softmax attention in O(n·m) with positive
orthogonal random features.

The softmax kernel is an expectation over Gaussian ``w``: with ``x = q·d^{-1/4}``, ``y = k·d^{-1/4}``,

    exp(q·k / sqrt(d)) = exp(x·y) = E_w[ exp(w·x - |x|²/2) · exp(w·y - |y|²/2) ],   w ~ N(0, I_d)

so ``φ(x) = m^{-1/2} [exp(w_i·x - |x|²/2)]_{i=1..m}`` gives an unbiased, always positive estimate
``φ(q)·φ(k)`` of every attention score. Attention becomes ``D⁻¹ φ(Q) (φ(K)ᵀ V)`` with
``D = diag(φ(Q) φ(K)ᵀ 1)``: O(n·m·d) instead of O(n²·d). Drawing the ``w_i`` in orthogonal blocks
(a QR factor of a Gaussian matrix, rows rescaled to Gaussian norms) keeps each row ``N(0, I)``
and lowers the variance (the paper's Theorem 2). The ratio of two unbiased estimates has an
O(1/m) bias; the numerator and the denominator are each unbiased.

Causal attention replaces ``φ(K)ᵀ V`` by its prefix sums, computed chunk by chunk (a small
masked ``c × c`` product inside a chunk plus the running sums), and generation keeps only those
sums: ``S = Σ_j φ(k_j) v_jᵀ`` (m × d) and ``z = Σ_j φ(k_j)`` (m) per head, whatever the length.

Numerical stabiliser (``stabilizer="bound"``, the default): key features are written
``exp(-|w_i - y|²/2)`` (``= exp(w·y - |y|²/2 - |w|²/2) <= 1``, never overflows, needs no look at
other keys, so recurrence is exact) and query features carry the ``exp(|w_i|²/2)`` back, minus their
own row maximum (a per-query constant that cancels in ``D⁻¹``). ``stabilizer="max"`` is the
reference code's choice (keys divided by the largest feature over the whole sequence), used to
compare with ``performer-pytorch``; its ``eps`` added to every feature is kept as an option.
"""

from __future__ import annotations

import math

import torch

from tformer.errors import InputError

Tensor = torch.Tensor


def gaussian_orthogonal(m: int, d: int, *, orthogonal: bool = True, generator: torch.Generator | None = None,
                        dtype: torch.dtype = torch.float32) -> Tensor:
    """``(m, d)`` random projection whose rows are each ``N(0, I_d)``.

    ``orthogonal``: rows come in blocks of ``d`` mutually orthogonal directions (QR of a Gaussian
    matrix), each rescaled to the norm of an independent Gaussian vector; else i.i.d. Gaussian rows.
    """
    if not orthogonal:
        return torch.randn(m, d, generator=generator).to(dtype)
    blocks = []
    for _ in range(math.ceil(m / d)):
        qmat, r = torch.linalg.qr(torch.randn(d, d, generator=generator, dtype=torch.float64))
        qmat = qmat * torch.sign(torch.diagonal(r))                          # Haar-uniform: each row uniform
        blocks.append(qmat.T)                                                # (d, d) orthonormal rows
    w = torch.cat(blocks)[:m]                                                # (m, d)
    norms = torch.randn(m, d, generator=generator, dtype=torch.float64).norm(dim=1, keepdim=True)
    return (w * norms).to(dtype)


def softmax_features(x: Tensor, proj: Tensor, *, is_query: bool, stabilizer: str = "bound",
                     eps: float = 0.0) -> Tensor:
    """Positive random features ``φ(x)``: ``(..., n, d)`` -> ``(..., n, m)`` (computed in fp32 or wider).

    ``φ(q)·φ(k)`` estimates ``exp(q·k / sqrt(d))`` up to a factor per query (which cancels).
    """
    dtype = torch.promote_types(x.dtype, torch.float32)
    x, proj = x.to(dtype), proj.to(dtype)
    x = x * x.shape[-1] ** -0.25                                             # (..., n, d)
    wx = torch.matmul(x, proj.T)                                             # (..., n, m)
    half_x2 = 0.5 * (x * x).sum(-1, keepdim=True)                           # (..., n, 1)
    if stabilizer == "bound":
        half_w2 = 0.5 * (proj * proj).sum(-1)                                # (m,)
        if is_query:
            log = wx - half_x2 + half_w2
            log = log - log.amax(dim=-1, keepdim=True).detach()              # per-query constant
        else:
            log = wx - half_x2 - half_w2                                     # = -|w - x|²/2 <= 0
    elif stabilizer == "max":                                                 # the reference code's choice
        dims = (-1,) if is_query else (-1, -2)
        log = wx - half_x2 - wx.amax(dim=dims, keepdim=True).detach()
    elif stabilizer == "none":                                                # the plain estimator (may overflow)
        log = wx - half_x2
    else:
        raise InputError(f"stabilizer={stabilizer!r} is not known; choose 'bound', 'max' or 'none'.")
    return (torch.exp(log) + eps) * proj.shape[0] ** -0.5


def favor_attention(qf: Tensor, kf: Tensor, v: Tensor) -> Tensor:
    """Bidirectional linear attention ``D⁻¹ φ(Q) (φ(K)ᵀ V)``: ``qf (.., n, m)``, ``kf (.., n', m)``,
    ``v (.., n', e)`` -> ``(.., n, e)``."""
    kv = torch.matmul(kf.transpose(-1, -2), v.to(kf.dtype))                 # (.., m, e)
    den = torch.matmul(qf, kf.sum(dim=-2).unsqueeze(-1))                     # (.., n, 1)
    out = torch.matmul(qf, kv) / den.clamp_min(torch.finfo(den.dtype).tiny)
    return out.to(v.dtype)


def favor_causal(qf: Tensor, kf: Tensor, v: Tensor, state: tuple[Tensor, Tensor] | None = None,
                 chunk: int = 64) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """Causal linear attention by prefix sums, chunk by chunk.

    Args:
        qf, kf: ``(B, H, T, m)`` features; v: ``(B, H, T, e)``.
        state: ``(S (B, H, m, e), z (B, H, m))``, the sums over earlier tokens, or ``None``.
        chunk: tokens per chunk (memory O(chunk² + m·e) per head).
    Returns:
        ``out (B, H, T, e)`` and the updated ``(S, z)``.
    """
    B, H, T, m = qf.shape
    e = v.shape[-1]
    vv = v.to(kf.dtype)
    if state is None:
        S = kf.new_zeros(B, H, m, e)
        z = kf.new_zeros(B, H, m)
    else:
        S, z = state
    outs = []
    for s in range(0, T, chunk):
        qc, kc, vc = qf[:, :, s:s + chunk], kf[:, :, s:s + chunk], vv[:, :, s:s + chunk]  # (B, H, c, *)
        c = qc.shape[2]
        a = torch.matmul(qc, kc.transpose(-1, -2)).tril()                    # (B, H, c, c) within the chunk
        num = torch.matmul(qc, S) + torch.matmul(a, vc)                      # (B, H, c, e)
        den = torch.matmul(qc, z.unsqueeze(-1)).squeeze(-1) + a.sum(-1)      # (B, H, c)
        outs.append(num / den.clamp_min(torch.finfo(den.dtype).tiny).unsqueeze(-1))
        S = S + torch.matmul(kc.transpose(-1, -2), vc)                       # (B, H, m, e)
        z = z + kc.sum(dim=2)                                                # (B, H, m)
    out = torch.cat(outs, dim=2) if outs else vv[:, :, :0]
    return out.to(v.dtype), (S, z)
