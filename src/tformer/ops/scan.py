"""The selective scan: the linear recurrence at the heart of a Mamba layer, and ways to compute it.

For each channel ``d`` of the ``E`` inner channels and each of its ``N`` state entries, Mamba runs the
discretised state-space recurrence (Gu & Dao 2023, eq. 2a-2b, zero-order hold for A, Euler for B):

    h_t = exp(Δ_t A) ⊙ h_{t-1} + Δ_t B_t x_t          h_t: (E, N) per sequence
    y_t = h_t C_t + D x_t                             y_t: (E,)

with ``A = -exp(A_log)`` (E, N) negative (so ``exp(Δ A)`` in (0, 1) decays the state), ``Δ_t`` (E,)
positive step sizes, ``B_t, C_t`` (N,) read/write vectors and ``D`` (E,) a skip. In the selective
layer Δ, B and C are functions of the input; in the LTI ablation (S4D) they are constants.

The recurrence ``h_t = a_t h_{t-1} + b_t`` is a first-order linear scan. It can be computed

- sequentially (:func:`selective_scan_reference`, the definition, one step at a time),
- by a plain loop over precomputed ``a, b``, in place, with a hand-written backward that is the
  same loop run backwards (:func:`scan_loop`; :func:`scan_loop_autograd` lets autograd record it),
- by recursive doubling (Hillis & Steele): ``log2 T`` passes over the whole sequence, each
  composing pairs ``(a, b)`` that are ``2^k`` apart (:func:`scan_doubling`),
- in chunks: doubling inside chunks of length ``L``, a loop carrying the state across chunks
  (:func:`scan_chunked`),
- in log space (Heinsen 2023): ``h_t = exp(S_t) · Σ_{s≤t} exp(-S_s) b_s`` with ``S`` the cumulative sum
  of ``log a``, computed with ``logcumsumexp`` on the positive and negative parts of ``b``
  (:func:`scan_logspace`).

Or, fastest on a CPU, with discretisation, recurrence and read-out fused into one loop per step and
a hand-written backward (:mod:`tformer.ops.scan_fused`). ``benchmarks/mamba/mamba_scan.py`` measures them all
on this CPU; :data:`FAST_SCAN` names the fastest, which the layer uses by default. ``tests/mixers/test_mamba.py`` checks that they all agree with the reference and with
``mambapy``'s parallel scan.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def selective_scan_reference(x: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor,
                             h0: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The recurrence, written out one time step at a time (the definition; slow, for checking).

    Args:
        x: ``(Bt, T, E)`` input to the SSM (after the convolution and SiLU).
        delta: ``(Bt, T, E)`` step sizes Δ (after softplus), or ``(E,)`` for the LTI layer.
        A: ``(E, N)`` negative state matrix (diagonal per channel).
        B, C: ``(Bt, T, N)`` input-dependent, or ``(E, N)`` constant (LTI).
        D: ``(E,)`` skip.
        h0: ``(Bt, E, N)`` state before the first step (zeros if ``None``).
    Returns:
        ``(y (Bt, T, E), h_T (Bt, E, N))``.
    """
    batch, T, E = x.shape
    h = x.new_zeros(batch, E, A.shape[1]) if h0 is None else h0
    ys = []
    for t in range(T):
        d_t = delta[:, t] if delta.dim() == 3 else delta.expand(batch, E)           # (Bt, E)
        B_t = B[:, t, None, :] if B.dim() == 3 else B                                # (Bt, 1, N) or (E, N)
        C_t = C[:, t, None, :] if C.dim() == 3 else C
        h = torch.exp(d_t[..., None] * A) * h + (d_t * x[:, t])[..., None] * B_t     # (Bt, E, N)
        ys.append((h * C_t).sum(-1) + D * x[:, t])                                   # (Bt, E)
    return torch.stack(ys, dim=1), h


def discretise(x: Tensor, delta: Tensor, A: Tensor, B: Tensor) -> tuple[Tensor, Tensor]:
    """``a = exp(Δ A)`` and ``b = Δ B x``, both ``(Bt, T, E, N)`` (B either ``(Bt, T, N)`` or ``(E, N)``)."""
    if delta.dim() == 1:
        delta = delta.expand_as(x)                                                   # (Bt, T, E)
    a = torch.exp(delta[..., None] * A)                                              # (Bt, T, E, N)
    B = B[:, :, None, :] if B.dim() == 3 else B                                      # (Bt, T, 1, N) or (E, N)
    return a, (delta * x)[..., None] * B                                             # (Bt, T, E, N)


def readout(h: Tensor, x: Tensor, C: Tensor, D: Tensor) -> Tensor:
    """``y_t = h_t C_t + D x_t`` for all states ``h (Bt, T, E, N)`` -> ``(Bt, T, E)``."""
    if C.dim() == 3:                                                                  # selective: C (Bt, T, N)
        return (h @ C[..., None]).squeeze(-1) + D * x                                # (Bt, T, E)
    return (h[..., None, :] @ C[..., None]).flatten(-3) + D * x                      # LTI: C (E, N)


# ---------------------------------------------------------------- linear scans h_t = a_t h_{t-1} + b_t
def _loop(a: Tensor, b: Tensor, h0: Tensor | None) -> Tensor:
    """``h_t = a_t h_{t-1} + b_t`` along dim 1, each step written in place into one preallocated output."""
    h = torch.empty_like(b)                                                           # (Bt, T, E, N)
    prev = torch.zeros_like(b[:, 0]) if h0 is None else h0
    for t in range(a.shape[1]):
        torch.addcmul(b[:, t], a[:, t], prev, out=h[:, t])
        prev = h[:, t]
    return h


class _LoopScan(torch.autograd.Function):
    """The loop with its own backward, itself a loop running backwards in time: with ``g_t`` the
    gradient reaching ``h_t`` from the loss and from ``h_{t+1}``,

        g_t = ∂L/∂h_t + a_{t+1} g_{t+1},   ∂L/∂b_t = g_t,   ∂L/∂a_t = g_t h_{t-1},   ∂L/∂h0 = a_0 g_0,

    so autograd stores no per-step graph (on CPU that graph, not the arithmetic, is the cost)."""

    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor, h0: Tensor | None) -> Tensor:
        h = _loop(a, b, h0)
        ctx.save_for_backward(a, h, h0)
        return h

    @staticmethod
    def backward(ctx, grad_h: Tensor):
        a, h, h0 = ctx.saved_tensors
        a_next = torch.cat([a[:, 1:], torch.zeros_like(a[:, :1])], dim=1)             # a_{t+1}, 0 past the end
        g = _loop(a_next.flip(1), grad_h.flip(1), None).flip(1)                       # (Bt, T, E, N)
        h_prev = torch.cat([torch.zeros_like(h[:, :1]) if h0 is None else h0[:, None], h[:, :-1]], dim=1)
        return g * h_prev, g, (a[:, 0] * g[:, 0] if h0 is not None else None)


def scan_loop(a: Tensor, b: Tensor, h0: Tensor | None = None) -> Tensor:
    """All states ``(Bt, T, E, N)`` by a plain loop over time (in place, with a hand-written backward)."""
    return _LoopScan.apply(a, b, h0)


def scan_loop_autograd(a: Tensor, b: Tensor, h0: Tensor | None = None) -> Tensor:
    """The same loop, differentiated by autograd step by step (for the benchmark's comparison)."""
    h = torch.zeros_like(b[:, 0]) if h0 is None else h0
    hs = []
    for t in range(a.shape[1]):
        h = a[:, t] * h + b[:, t]
        hs.append(h)
    return torch.stack(hs, dim=1)


def _doubling(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """Inclusive scan along dim 1 by recursive doubling: after pass k, ``(a_t, b_t)`` composes the
    ``2^(k+1)`` steps ending at t; returns (product of a, state from a zero start)."""
    T, shift = a.shape[1], 1
    while shift < T:
        # (a_t, b_t) ∘ (a_{t-s}, b_{t-s}) = (a_t a_{t-s}, a_t b_{t-s} + b_t); the first s stay as they are.
        a, b = (torch.cat([a[:, :shift], a[:, shift:] * a[:, :-shift]], dim=1),
                torch.cat([b[:, :shift], a[:, shift:] * b[:, :-shift] + b[:, shift:]], dim=1))
        shift *= 2
    return a, b


def scan_doubling(a: Tensor, b: Tensor, h0: Tensor | None = None) -> Tensor:
    """All states by recursive doubling (Hillis & Steele): ``log2 T`` full-sequence passes."""
    a_cum, h = _doubling(a, b)
    return h if h0 is None else h + a_cum * h0[:, None]


def scan_chunked(a: Tensor, b: Tensor, h0: Tensor | None = None, chunk: int = 32) -> Tensor:
    """All states by doubling inside chunks of ``chunk`` steps, a loop carrying the state across them."""
    h = torch.zeros_like(b[:, 0]) if h0 is None else h0
    out = []
    for s in range(0, a.shape[1], chunk):
        a_cum, hs = _doubling(a[:, s:s + chunk], b[:, s:s + chunk])
        hs = hs + a_cum * h[:, None]
        out.append(hs)
        h = hs[:, -1]
    return torch.cat(out, dim=1)


def scan_logspace(a: Tensor, b: Tensor, h0: Tensor | None = None) -> Tensor:
    """All states in log space (Heinsen 2023): ``h_t = exp(S_t) Σ_{s≤t} exp(log b_s - S_s)``,
    ``S_t = Σ_{r≤t} log a_r``; ``b`` split into positive and negative parts so logs are real."""
    if h0 is not None:  # fold the initial state in as a step 0 with b = h0
        a = torch.cat([torch.ones_like(a[:, :1]), a], dim=1)
        b = torch.cat([h0[:, None], b], dim=1)
    S = torch.log(a).cumsum(dim=1)                                                    # (Bt, T, E, N)
    pos = torch.logcumsumexp(torch.log(b.clamp(min=0)) - S, dim=1)
    neg = torch.logcumsumexp(torch.log((-b).clamp(min=0)) - S, dim=1)
    h = torch.exp(S + pos) - torch.exp(S + neg)
    return h if h0 is None else h[:, 1:]


SCANS = {"loop": scan_loop, "loop-autograd": scan_loop_autograd, "doubling": scan_doubling,
         "chunked": scan_chunked, "logspace": scan_logspace}
METHODS = (*SCANS, "fused")  # "fused": discretisation, scan and read-out in one loop (tformer.ops.scan_fused)
FAST_SCAN = "fused"  # measured fastest here, forward and backward: benchmarks/results/mamba/mamba_scan.md


def selective_scan(x: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor,
                   h0: Tensor | None = None, method: str = FAST_SCAN) -> tuple[Tensor, Tensor]:
    """The same result as :func:`selective_scan_reference`, computed with ``method`` (one of :data:`METHODS`).

    Returns:
        ``(y (Bt, T, E), h_T (Bt, E, N))``.
    """
    if method == "fused":
        from tformer.ops.scan_fused import selective_scan_fused
        return selective_scan_fused(x, delta, A, B, C, D, h0)
    a, b = discretise(x, delta, A, B)                                                 # (Bt, T, E, N) each
    h = SCANS[method](a, b, h0)                                                       # (Bt, T, E, N)
    return readout(h, x, C, D), h[:, -1]


def selective_step(x: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor,
                   h: Tensor) -> tuple[Tensor, Tensor]:
    """One recurrent step for generation: ``x, delta (Bt, E)``, ``B, C`` broadcastable to
    ``(Bt, E, N)`` (``(Bt, 1, N)`` selective, ``(E, N)`` LTI), ``h (Bt, E, N)`` -> ``(y (Bt, E), new h)``."""
    h = torch.exp(delta[..., None] * A) * h + (delta * x)[..., None] * B             # (Bt, E, N)
    return (h * C).sum(-1) + D * x, h
