"""FlashAttention on the CPU: exact attention in O(n) memory (Dao et al., 2022; Dao, 2023).

The math backend builds the ``(n, m)`` score matrix, softmaxes it and multiplies by V. Here the
queries are cut into blocks of ``block_q`` rows and the keys/values into blocks of ``block_k``;
for each query block we walk over the key blocks keeping, per row, the running maximum ``m_i``
and the running sum ``l_i`` of ``exp(s - m_i)`` (the "online softmax"). When a new block raises
the maximum, the sum and the output accumulator are rescaled by ``exp(m_old - m_new)``. At the
end ``out = acc / l`` and ``lse = m + log l``; only ``out`` and ``lse`` (O(n)) are kept.

Backward recomputes each probability block from the saved log-sum-exp, ``P = exp(S - lse)``,
and with ``D = rowsum(dO * O)`` forms ``dV += Pᵀ dO``, ``dP = dO Vᵀ``, ``dS = P * (dP - D)``,
``dQ += dS K``, ``dK += dSᵀ Q``: again one block at a time, never an ``(n, m)`` matrix.

Everything that decides which scores are allowed is computed per block from its definition:
causal (bottom-right aligned), sliding window, ALiBi (``-slope_h * |p_q - p_k|``) and key-padding
masks of shape ``(B, 1, 1, m)``. Blocks with no allowed pair are skipped, so causal attention does
about half the work and a window only a band. A general dense ``(..., n, m)`` mask or float bias
is also accepted and sliced per block (that input itself is then O(n·m), of course).

Layout: queries are arranged as ``(B, Hkv, n, G, d)`` (G = query heads per key/value head), so a
query block is one ``(B, Hkv, bn·G, d)`` view and a single batched matmul against the
``(B, Hkv, bm, d)`` key block serves all G heads of a group without repeating K or V.
bf16/fp16 inputs are computed in fp32 and the output cast back.
"""

from __future__ import annotations

import math

import torch

from tformer.ops.checks import check_shapes
from tformer.errors import InputError

Tensor = torch.Tensor

# Chosen by measurement on a 2-core CPU at d_head 64 (see docs/flash-attention.md): big enough that
# the matmuls are efficient, small enough that a (B·H, block_q, block_k) fp32 block stays a few MB.
DEFAULT_BLOCK_Q = 256
DEFAULT_BLOCK_K = 256

SKIP, FULL, PARTIAL = 0, 1, 2


def flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    causal: bool = False,
    window: int | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
) -> Tensor:
    """Exact attention ``softmax(Q Kᵀ · scale + bias) V`` computed block by block.

    Args:
        q: ``(..., Hq, n, d_k)`` (or ``(..., n, d_k)``); k ``(..., Hkv, m, d_k)``; v ``(..., Hkv, m, d_v)``.
        mask: bool, ``True`` = attend, broadcastable to ``(..., Hq, n, m)``; a key-padding mask
            ``(B, 1, 1, m)`` stays O(m).
        bias: float added to the scores, broadcastable likewise (differentiable).
        alibi_slopes: ``(Hq,)``; adds ``-slope_h * |p_q - p_k|`` with queries at key positions
            ``m - n .. m - 1`` (as ``tformer.ops.alibi.alibi_bias``), computed per block.
        causal: bottom-right aligned; window: ``|p_q - p_k| < window`` (and ``p_k <= p_q`` if causal).
        scale: default ``1 / sqrt(d_k)``.
        dropout_p: must be 0 (this kernel has no dropout).
        block_q, block_k: rows of queries / keys per block.

    Returns:
        ``(..., Hq, n, d_v)`` in the dtype of ``q``; rows that may attend to nothing are zero.

    Raises:
        InputError: for inconsistent q/k/v shapes, dropout, bad block sizes, or masks/biases/slopes
            of an unusable shape.
    """
    check_shapes(q, k, v)
    if dropout_p > 0:
        raise InputError(
            f"the flash backend has no attention dropout (dropout_p={dropout_p}); use backend='torch' "
            f"or 'math' when training with attn_dropout > 0, or backend='auto' which does so."
        )
    if block_q < 1 or block_k < 1:
        raise InputError(f"block_q={block_q} and block_k={block_k} must be positive integers.")
    if window is not None and window < 1:
        raise InputError(f"window={window} must be >= 1.")
    if mask is not None and mask.dtype != torch.bool:
        raise InputError(f"mask must be a bool tensor (True = attend), got {mask.dtype}; pass floats as bias=.")
    n, m, dv = q.shape[-2], k.shape[-2], v.shape[-1]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    compute = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype

    has_heads = q.dim() >= 3 and k.dim() == q.dim()
    if not has_heads:  # no head dim: give everything one
        q, k, v = q.unsqueeze(-3), k.unsqueeze(-3), v.unsqueeze(-3)
        mask = None if mask is None else _pad_dims(mask, q.dim() - 1).unsqueeze(-3)
        bias = None if bias is None else _pad_dims(bias, q.dim() - 1).unsqueeze(-3)
    hq, hkv = q.shape[-3], k.shape[-3]
    groups = hq // hkv
    lead = torch.broadcast_shapes(q.shape[:-3], k.shape[:-3])
    b = math.prod(lead)

    # (B, Hkv, n, G, d_k), pre-scaled, in the compute dtype; k, v: (B, Hkv, m, d)
    q5 = (q.to(compute) * scale).expand(*lead, hq, n, q.shape[-1]).reshape(b, hkv, groups, n, -1)
    q5 = q5.transpose(2, 3).contiguous()
    k4 = k.to(compute).expand(*lead, hkv, m, k.shape[-1]).reshape(b, hkv, m, -1).contiguous()
    v4 = v.to(compute).expand(*lead, hkv, m, dv).reshape(b, hkv, m, dv).contiguous()
    mask5 = None if mask is None else _pairwise(mask, lead, hq, hkv, n, m, "mask")
    bias5 = None if bias is None else _pairwise(bias.to(compute), lead, hq, hkv, n, m, "bias")
    slopes5 = None
    if alibi_slopes is not None:
        if alibi_slopes.shape not in ((hq,), (1,)):
            raise InputError(f"alibi_slopes must have shape ({hq},) (one per query head), got {tuple(alibi_slopes.shape)}.")
        slopes5 = alibi_slopes.to(compute).expand(hq).reshape(1, hkv, 1, groups, 1)

    geometry = _Geometry(n, m, causal, window, block_q, block_k)
    out5 = _FlashAttention.apply(q5, k4, v4, bias5, slopes5, mask5, geometry)  # (B, Hkv, n, G, d_v)
    out = out5.transpose(2, 3).reshape(*lead, hq, n, dv).to(q.dtype)
    return out if has_heads else out.squeeze(-3)


def flash_backend(q, k, v, mask, bias, causal, window, scale, dropout_p, alibi_slopes=None) -> Tensor:
    """The ``"flash"`` entry of ``EXTRA_BACKENDS`` (default block sizes)."""
    return flash_attention(q, k, v, mask=mask, bias=bias, alibi_slopes=alibi_slopes, causal=causal,
                           window=window, scale=scale, dropout_p=dropout_p)


# ------------------------------------------------------------------------------- block geometry
class _Geometry:
    """Which (query block, key block) pairs exist and whether each is skipped, full or partial.

    Query ``i`` sits at key position ``p = i + m - n`` (bottom-right alignment).
    """

    def __init__(self, n: int, m: int, causal: bool, window: int | None, block_q: int, block_k: int):
        self.n, self.m, self.causal, self.window = n, m, causal, window
        self.block_q, self.block_k = block_q, block_k
        self.q_blocks = [(i, min(i + block_q, n)) for i in range(0, n, block_q)]
        self.k_blocks = [(j, min(j + block_k, m)) for j in range(0, m, block_k)]

    def state(self, i0: int, i1: int, j0: int, j1: int) -> int:
        """SKIP if no query of rows [i0, i1) may see a key of [j0, j1), FULL if all may, else PARTIAL."""
        off, w = self.m - self.n, self.window
        p_lo, p_hi, k_lo, k_hi = i0 + off, i1 - 1 + off, j0, j1 - 1
        if w is None:
            if not self.causal:
                return FULL
            if k_lo > p_hi:
                return SKIP
            return FULL if k_hi <= p_lo else PARTIAL
        if self.causal:  # keys in (p - w, p]
            if k_lo > p_hi or k_hi <= p_lo - w:
                return SKIP
            return FULL if (k_hi <= p_lo and k_lo > p_hi - w) else PARTIAL
        if k_lo > p_hi + w - 1 or k_hi < p_lo - w + 1:  # |p - j| < w
            return SKIP
        return FULL if max(p_hi - k_lo, k_hi - p_lo) < w else PARTIAL

    def structural(self, i0: int, i1: int, j0: int, j1: int, device) -> Tensor:
        """``(bn, 1, bm)`` bool: causal/window constraint of a PARTIAL block."""
        p = torch.arange(i0, i1, device=device)[:, None, None] + (self.m - self.n)
        j = torch.arange(j0, j1, device=device)[None, None, :]
        ok = torch.ones((), dtype=torch.bool, device=device)
        if self.causal:
            ok = j <= p
        if self.window is not None:
            ok = ok & ((p - j).abs() < self.window)
        return ok

    def distance(self, i0: int, i1: int, j0: int, j1: int, dtype, device) -> Tensor:
        """``(bn, 1, bm)`` ``|p_q - p_k|`` for ALiBi."""
        p = torch.arange(i0, i1, device=device, dtype=dtype)[:, None, None] + (self.m - self.n)
        j = torch.arange(j0, j1, device=device, dtype=dtype)[None, None, :]
        return (p - j).abs()

    def visited(self) -> int:
        """How many blocks are computed (not skipped)."""
        return sum(self.state(*qb, *kb) != SKIP for qb in self.q_blocks for kb in self.k_blocks)


def _pad_dims(t: Tensor, ndim: int) -> Tensor:
    return t.reshape((1,) * (ndim - t.dim()) + tuple(t.shape)) if t.dim() < ndim else t


def _pairwise(t: Tensor, lead, hq: int, hkv: int, n: int, m: int, what: str) -> Tensor:
    """A mask/bias broadcastable to ``(*lead, Hq, n, m)`` as a ``(B|1, Hkv|1, n|1, G|1, m|1)`` view."""
    t = _pad_dims(t, len(lead) + 3)
    if t.dim() > len(lead) + 3:
        raise InputError(f"{what} has shape {tuple(t.shape)}, more dims than the scores {(*lead, hq, n, m)}.")
    th, tn, tm = t.shape[-3:]
    if th not in (1, hq) or tn not in (1, n) or tm not in (1, m):
        raise InputError(f"{what} of shape {tuple(t.shape)} does not broadcast to the scores {(*lead, hq, n, m)}.")
    if all(s == 1 for s in t.shape[:-3]):
        t = t.reshape(1, th, tn, tm)
    else:
        t = t.expand(*lead, th, tn, tm).reshape(-1, th, tn, tm)
    t = t.unflatten(1, (hkv, hq // hkv)) if th == hq else t.unsqueeze(1)
    return t.transpose(2, 3)  # (B, Hkv, n, G, m), size-1 where broadcast


def _block(t: Tensor | None, i0: int, i1: int, j0: int, j1: int) -> Tensor | None:
    if t is None:
        return None
    rows = slice(i0, i1) if t.shape[2] > 1 else slice(None)
    cols = slice(j0, j1) if t.shape[4] > 1 else slice(None)
    return t[:, :, rows, :, cols]


def _scores(q5, kb, bias5, slopes5, mask5, geo: _Geometry, state, i0, i1, j0, j1) -> Tensor:
    """Masked, biased scores of one block: ``(B, Hkv, bn, G, bm)``."""
    b, hkv, _, g, dk = q5.shape
    bn, bm = i1 - i0, j1 - j0
    s = torch.matmul(q5[:, :, i0:i1].reshape(b, hkv, bn * g, dk), kb.transpose(-1, -2)).view(b, hkv, bn, g, bm)
    if bias5 is not None:
        s += _block(bias5, i0, i1, j0, j1)
    if slopes5 is not None:
        s.addcmul_(slopes5, geo.distance(i0, i1, j0, j1, s.dtype, s.device), value=-1.0)
    allowed = _block(mask5, i0, i1, j0, j1)
    if state == PARTIAL:
        structural = geo.structural(i0, i1, j0, j1, s.device)
        allowed = structural if allowed is None else allowed & structural
    if allowed is not None:
        s.masked_fill_(~allowed, float("-inf"))
    return s


def _live_key_blocks(mask5: Tensor | None, geo: _Geometry) -> list[bool]:
    """For a key-padding mask (no query dim), which key blocks hold at least one real key."""
    if mask5 is None or mask5.shape[2] > 1 or mask5.shape[4] == 1:
        return [True] * len(geo.k_blocks)
    return [bool(mask5[..., j0:j1].any()) for j0, j1 in geo.k_blocks]


# ------------------------------------------------------------- forward on PyTorch's fused block kernel
_fused_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _spans(geo: _Geometry, i0: int, i1: int, merge: bool):
    """The visible key ranges of query block [i0, i1) as ``(j0, j1, state)``; with ``merge``, runs of
    FULL blocks become one range (they need no mask, so one kernel call serves them all)."""
    spans: list[list] = []
    for j0, j1 in geo.k_blocks:
        state = geo.state(i0, i1, j0, j1)
        if state == SKIP:
            continue
        if merge and state == FULL and spans and spans[-1][2] == FULL and spans[-1][1] == j0:
            spans[-1][1] = j1
        else:
            spans.append([j0, j1, state])
    return spans


def _forward_by_fused_blocks(q5, k4, v4, slopes5, geo: _Geometry) -> tuple[Tensor, Tensor]:
    """The forward without masks or dense biases, on the CPU: for each query block, PyTorch's fused
    kernel over each visible key range gives a normalised partial output ``O_j`` and its log-sum-exp
    ``L_j``; they combine exactly as ``L = log Σ_j exp(L_j)``, ``O = Σ_j exp(L_j - L) O_j`` (the online
    softmax, applied to whole ranges). Causal and window edges (PARTIAL blocks) and ALiBi reach the
    kernel as a per-block ``(rows, bm)`` bias, so memory stays O(n · block). Returns ``out5, lse5``."""
    b, hkv, n, g, dk = q5.shape
    dv = v4.shape[-1]
    out5 = q5.new_zeros(b, hkv, n, g, dv)
    lse5 = q5.new_full((b, hkv, n, g, 1), float("inf"))   # +inf: exp(s - lse) = 0 on empty rows
    for i0, i1 in geo.q_blocks:
        bn = i1 - i0
        rows = bn * g
        qb = q5[:, :, i0:i1].reshape(b, hkv, rows, dk)                       # row r = (query r // g, head r % g)
        acc = lse = None
        for j0, j1, state in _spans(geo, i0, i1, merge=slopes5 is None):
            bias, dead = None, None
            if slopes5 is not None:                                            # -slope_h |p_q - p_k|: (1, Hkv, rows, bm)
                dist = geo.distance(i0, i1, j0, j1, q5.dtype, q5.device)      # (bn, 1, bm)
                bias = (-slopes5.view(1, hkv, 1, g, 1) * dist).reshape(1, hkv, rows, j1 - j0)
            if state == PARTIAL:
                allowed = geo.structural(i0, i1, j0, j1, q5.device).expand(bn, g, j1 - j0)
                blocked = torch.zeros((), dtype=q5.dtype, device=q5.device).masked_fill(~allowed, float("-inf"))
                blocked = blocked.expand(bn, g, j1 - j0).reshape(1, 1, rows, j1 - j0)
                bias = blocked if bias is None else bias + blocked
                dead = ~allowed.any(-1).reshape(rows)                          # rows that see no key here
            o, lj = _fused_cpu(qb, k4[:, :, j0:j1], v4[:, :, j0:j1], 0.0, False, attn_mask=bias, scale=1.0)
            if dead is not None and bool(dead.any()):
                lj = lj.masked_fill(dead, float("-inf"))                       # the kernel reports 0 for them
            if acc is None:
                acc, lse = o, lj                                               # (B, Hkv, rows, d_v), (B, Hkv, rows)
                continue
            new = torch.logaddexp(lse, lj)
            safe = new.masked_fill(new == float("-inf"), 0.0)
            acc = acc * (lse - safe).exp().unsqueeze(-1) + o * (lj - safe).exp().unsqueeze(-1)
            lse = new
        if acc is None:
            continue                                                           # no visible key at all
        out5[:, :, i0:i1] = acc.view(b, hkv, bn, g, dv)
        lse5[:, :, i0:i1] = lse.masked_fill(lse == float("-inf"), float("inf")).view(b, hkv, bn, g, 1)
    return out5, lse5


# --------------------------------------------------------------------------- the autograd kernel
class _FlashAttention(torch.autograd.Function):
    """q5 ``(B, Hkv, n, G, d_k)`` pre-scaled, k4 ``(B, Hkv, m, d_k)``, v4 ``(B, Hkv, m, d_v)``."""

    @staticmethod
    def forward(ctx, q5, k4, v4, bias5, slopes5, mask5, geo):
        if mask5 is None and bias5 is None and q5.device.type == "cpu" and q5.shape[-1] == v4.shape[-1]:
            out5, lse5 = _forward_by_fused_blocks(q5, k4, v4, slopes5, geo)
            ctx.save_for_backward(q5, k4, v4, bias5, slopes5, mask5, out5, lse5)
            ctx.geo = geo
            return out5
        b, hkv, n, g, _ = q5.shape
        dv = v4.shape[-1]
        out5 = q5.new_zeros(b, hkv, n, g, dv)
        lse5 = q5.new_full((b, hkv, n, g, 1), float("inf"))  # +inf: exp(s - lse) = 0 on empty rows
        live = _live_key_blocks(mask5, geo)
        for i0, i1 in geo.q_blocks:
            bn = i1 - i0
            m_i = q5.new_full((b, hkv, bn, g, 1), float("-inf"))     # running row max
            l_i = q5.new_zeros(b, hkv, bn, g, 1)                     # running row sum
            acc = q5.new_zeros(b * hkv, bn * g, dv)                  # unnormalised output
            for (j0, j1), alive in zip(geo.k_blocks, live):
                state = geo.state(i0, i1, j0, j1)
                if state == SKIP or not alive:
                    continue
                s = _scores(q5, k4[:, :, j0:j1], bias5, slopes5, mask5, geo, state, i0, i1, j0, j1)
                m_new = torch.maximum(m_i, s.amax(-1, keepdim=True))
                m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)  # rows with nothing seen yet
                p = s.sub_(m_safe).exp_()                                # (B, Hkv, bn, G, bm)
                alpha = (m_i - m_safe).exp_()                            # rescales the old sums
                l_i.mul_(alpha).add_(p.sum(-1, keepdim=True))
                acc.mul_(alpha.view(b * hkv, bn * g, 1))
                acc.baddbmm_(p.view(b * hkv, bn * g, j1 - j0), v4[:, :, j0:j1].reshape(b * hkv, j1 - j0, dv))
                m_i = m_new
            empty = l_i == 0
            out5[:, :, i0:i1] = acc.view(b, hkv, bn, g, dv) / l_i.masked_fill(empty, 1.0)
            lse5[:, :, i0:i1] = torch.where(empty, float("inf"), m_i + l_i.log())
        ctx.save_for_backward(q5, k4, v4, bias5, slopes5, mask5, out5, lse5)
        ctx.geo = geo
        return out5

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout5):
        q5, k4, v4, bias5, slopes5, mask5, out5, lse5 = ctx.saved_tensors
        geo = ctx.geo
        b, hkv, n, g, dk = q5.shape
        dv = v4.shape[-1]
        do5 = dout5.contiguous()
        delta5 = (do5 * out5).sum(-1, keepdim=True)                      # D = rowsum(dO * O)
        want_bias = bias5 is not None and ctx.needs_input_grad[3]
        want_slopes = slopes5 is not None and ctx.needs_input_grad[4]
        dq5, dk4, dv4 = torch.zeros_like(q5), torch.zeros_like(k4), torch.zeros_like(v4)
        dbias5 = torch.zeros_like(bias5) if want_bias else None
        dslopes5 = torch.zeros_like(slopes5) if want_slopes else None
        live = _live_key_blocks(mask5, geo)
        for (j0, j1), alive in zip(geo.k_blocks, live):
            if not alive:
                continue
            bm = j1 - j0
            kb, vb = k4[:, :, j0:j1], v4[:, :, j0:j1]
            dkb = dk4[:, :, j0:j1].view(b * hkv, bm, dk)
            dvb = dv4[:, :, j0:j1].view(b * hkv, bm, dv)
            for i0, i1 in geo.q_blocks:
                state = geo.state(i0, i1, j0, j1)
                if state == SKIP:
                    continue
                rows = (i1 - i0) * g
                s = _scores(q5, kb, bias5, slopes5, mask5, geo, state, i0, i1, j0, j1)
                p = s.sub_(lse5[:, :, i0:i1]).exp_()                    # probabilities, recomputed
                p3 = p.view(b * hkv, rows, bm)
                do3 = do5[:, :, i0:i1].view(b * hkv, rows, dv)
                dvb.baddbmm_(p3.transpose(1, 2), do3)                    # dV += Pᵀ dO
                dp = torch.bmm(do3, vb.reshape(b * hkv, bm, dv).transpose(1, 2))  # dP = dO Vᵀ
                ds = dp.view_as(p).sub_(delta5[:, :, i0:i1]).mul_(p)     # dS = P (dP - D)
                ds3 = ds.view(b * hkv, rows, bm)
                dq5[:, :, i0:i1].view(b * hkv, rows, dk).baddbmm_(ds3, kb.reshape(b * hkv, bm, dk))
                dkb.baddbmm_(ds3.transpose(1, 2), q5[:, :, i0:i1].reshape(b * hkv, rows, dk))
                if want_bias:
                    target = _block(dbias5, i0, i1, j0, j1)
                    target += ds.sum_to_size(target.shape)
                if want_slopes:
                    dist = geo.distance(i0, i1, j0, j1, ds.dtype, ds.device)
                    dslopes5 -= (ds * dist).sum_to_size(dslopes5.shape)
        return dq5, dk4, dv4, dbias5, dslopes5, None, None
