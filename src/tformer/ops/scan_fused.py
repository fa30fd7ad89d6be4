"""The whole selective scan as one autograd Function: discretisation, recurrence and read-out fused
into one loop over time, with a hand-written backward that is a loop backwards in time.

Why: the other scans (:mod:`tformer.ops.scan`) first build ``a = exp(ΔA)`` and ``b = ΔBx`` as
``(Bt, T, E, N)`` tensors and autograd keeps several more of that size. On a CPU that memory traffic,
not the arithmetic, is the cost. Here each step touches only ``(Bt, E, N)`` (which stays in cache);
the forward keeps the states ``h`` for the backward and nothing else of that size.

Forward, per step t (shapes per sequence: ``h (E, N)``, ``x_t, Δ_t (E,)``, ``B_t, C_t (N,)``):

    a_t = exp(Δ_t A),   h_t = a_t h_{t-1} + (Δ_t x_t) B_t,   y_t = h_t C_t + D x_t

Backward, from ``ȳ_t = ∂L/∂y_t``, carrying ``g`` = the gradient reaching ``h_t`` (from ``y_t`` and
from ``h_{t+1}``) back in time:

    g_t  = ȳ_t C_tᵀ + a_{t+1} g_{t+1}
    C̄_t  = Σ_E ȳ_t h_t             B̄_t = Σ_E g_t (Δ_t x_t)
    Δ̄_t  = Σ_N g_t h_{t-1} a_t A + x_t Σ_N g_t B_t
    x̄_t  = Δ_t Σ_N g_t B_t + D ȳ_t     Ā = Σ_t Σ_batch g_t h_{t-1} a_t Δ_t
    D̄    = Σ_t ȳ_t x_t              h̄_0 = a_0 g_0

``tests/mixers/test_mamba.py`` checks it with ``torch.autograd.gradcheck`` (finite differences) and against
the step-by-step reference.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def _B(B: Tensor, t: int) -> Tensor:
    """Step t's ``B`` (or ``C``) broadcastable to ``(Bt, E, N)``: ``(Bt, 1, N)`` selective, ``(E, N)`` LTI."""
    return B[:, t, None, :] if B.dim() == 3 else B


def _forward(x: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor, h0: Tensor | None,
             keep_states: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(y, h_T, every state or None)``: the loop, keeping the ``(Bt, T, E, N)`` states only for a backward."""
    batch, T, E = x.shape
    hs = x.new_empty(batch, T, E, A.shape[1]) if keep_states else None
    y = torch.empty_like(x)                                                          # (Bt, T, E)
    h = x.new_zeros(batch, E, A.shape[1]) if h0 is None else h0
    for t in range(T):
        a = torch.exp(delta[:, t, :, None] * A)                                      # (Bt, E, N)
        b = (delta[:, t] * x[:, t])[..., None] * _B(B, t)                            # (Bt, E, N)
        h = torch.addcmul(b, a, h, out=hs[:, t]) if keep_states else torch.addcmul(b, a, h)
        y[:, t] = (h * _B(C, t)).sum(-1)                                             # (Bt, E)
    return y + D * x, h, hs


class SelectiveScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor, h0: Tensor | None):
        y, h, hs = _forward(x, delta, A, B, C, D, h0, keep_states=True)
        ctx.save_for_backward(x, delta, A, B, C, D, h0, hs)
        return y, h.clone()

    @staticmethod
    def backward(ctx, gy: Tensor, gh_last: Tensor):
        x, delta, A, B, C, D, h0, hs = ctx.saved_tensors
        T = x.shape[1]
        gx, gdelta = D * gy, torch.empty_like(delta)                                 # (Bt, T, E)
        gB = torch.zeros_like(B) if B.dim() == 2 else torch.empty_like(B)
        gC = torch.zeros_like(C) if C.dim() == 2 else torch.empty_like(C)
        gA = torch.zeros_like(A)
        g = gh_last.clone()                                                          # (Bt, E, N)
        for t in reversed(range(T)):
            g += gy[:, t, :, None] * _B(C, t)                                        # ∂L/∂h_t
            h_prev = hs[:, t - 1] if t > 0 else (torch.zeros_like(g) if h0 is None else h0)
            a = torch.exp(delta[:, t, :, None] * A)
            g_log_a = g * h_prev * a                                                 # ∂L/∂(Δ_t A)
            gB_sum = (g * _B(B, t)).sum(-1)                                          # Σ_N g B  (Bt, E)
            gdelta[:, t] = (g_log_a * A).sum(-1) + x[:, t] * gB_sum
            gx[:, t] += delta[:, t] * gB_sum
            gA += (g_log_a * delta[:, t, :, None]).sum(0)
            dx = (delta[:, t] * x[:, t])[..., None]                                  # (Bt, E, 1)
            if B.dim() == 3:
                gB[:, t] = (g * dx).sum(1)
                gC[:, t] = (gy[:, t, :, None] * hs[:, t]).sum(1)
            else:
                gB += (g * dx).sum(0)
                gC += (gy[:, t, :, None] * hs[:, t]).sum(0)
            g = g * a                                                                # on to h_{t-1}
        gD = (gy * x).sum((0, 1))
        return gx, gdelta, gA, gB, gC, gD, (g if h0 is not None else None)


def selective_scan_fused(x: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor,
                         h0: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(y (Bt, T, E), h_T (Bt, E, N))`` as :func:`tformer.ops.scan.selective_scan_reference`;
    ``delta (Bt, T, E)`` or ``(E,)``, ``B, C (Bt, T, N)`` or ``(E, N)``."""
    if delta.dim() == 1:
        delta = delta.expand_as(x)
    inputs = (x, delta, A, B, C, D, h0)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs):
        return SelectiveScan.apply(*inputs)
    return _forward(*inputs, keep_states=False)[:2]                                  # inference: no (T, E, N) store
