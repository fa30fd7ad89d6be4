"""Longformer attention (Beltagy et al., 2020): a sliding window plus a few global tokens, in O(n·w).

Query ``p`` (not global) attends to the keys ``j`` of its window and to every global key:

    window(p) = { j : |p - j| < w·d, (p - j) divisible by d, and j <= p if causal }

(``w`` = ``window`` keys on each side counting ``p`` itself, ``d`` = ``dilation``). A global key
inside the window counts once. A global query attends to every key (``j <= p`` if causal) with
its own projections ``Q_g, K_g, V_g``, as in the paper (§3.1, "linear projections for global
attention").

Cost. The sequence is cut into query blocks of ``c = w`` rows; block ``b`` sees the key span
``[b·c - (w-1), b·c + c - 1 + (w-1)]`` (``L = c + 2(w-1)`` keys, ``c + w - 1`` if causal), taken as a
strided view (``unfold``) of the padded keys, so scores are ``(B, H, n/c, c, L)``: O(n·w) time
and memory, never an ``(n, n)`` tensor. Dilation ``d`` is exact and free: position ``p`` only meets
positions congruent to it mod ``d``, so the sequence splits into ``d`` interleaved sequences
(``x[r::d]``), each with an ordinary window ``w``. Global rows cost O(g·n).

Masks: ``True`` = may attend (the tformer convention). Queries with nothing to attend get zeros.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tformer.ops.masks import masked_softmax

Tensor = torch.Tensor


def _band(c: int, L: int, reach: int, causal: bool, device) -> Tensor:
    """``(c, L)`` bool: query ``a`` of a block may see span key ``l`` (``p - j = a + reach - l``)."""
    a = torch.arange(c, device=device).unsqueeze(1)
    l_ = torch.arange(L, device=device).unsqueeze(0)
    dist = a + reach - l_                                                     # p - j
    return (dist >= 0) & (dist <= reach) if causal else dist.abs() <= reach


def _unfold(x: Tensor, c: int, left: int, right: int, L: int, value=0.0) -> Tensor:
    """``x (B, H, n_pad, e)`` -> ``(B, H, nb, L, e)``: block ``b``'s key span, a strided view."""
    x = F.pad(x, (0, 0, left, right), value=value)                           # (B, H, left + n_pad + right, e)
    return x.unfold(2, L, c).transpose(-1, -2)                                # (B, H, nb, L, e)


def window_scores(q: Tensor, k: Tensor, key_ok: Tensor, window: int, causal: bool, scale: float):
    """Scores of each query against its window, block by block.

    Args:
        q, k: ``(B, H, n, e)`` with ``n`` a multiple of ``window``.
        key_ok: ``(B, H, n)`` bool, keys that may be attended by the window part.
    Returns:
        ``scores (B, H, nb, c, L)``, ``ok (B, H, nb, c, L)`` and ``span(x)``, a function taking
        ``(B, H, n, e)`` to the matching ``(B, H, nb, L, e)`` key span.
    """
    B, H, n, _ = q.shape
    c, reach = window, window - 1
    left, right = reach, 0 if causal else reach
    L = c + left + right
    span = lambda x: _unfold(x, c, left, right, L)                            # noqa: E731
    qb = q.view(B, H, n // c, c, -1)                                          # (B, H, nb, c, e)
    scores = torch.matmul(qb, span(k).transpose(-1, -2)) * scale              # (B, H, nb, c, L)
    ok_keys = _unfold(key_ok.unsqueeze(-1), c, left, right, L, value=False).squeeze(-1)  # (B, H, nb, L)
    ok = _band(c, L, reach, causal, q.device) & ok_keys.unsqueeze(-2)        # (B, H, nb, c, L)
    return scores, ok, span


def _split_dilation(x: Tensor, d: int) -> Tensor:
    """``(B, H, n, *e)`` with ``d | n`` -> ``(B, H·d, n/d, *e)``: the ``d`` interleaved sequences ``x[r::d]``."""
    B, H, n = x.shape[:3]
    rest = x.shape[3:]
    x = x.reshape(B, H, n // d, d, *rest).transpose(2, 3)                    # (B, H, d, n/d, *e)
    return x.reshape(B, H * d, n // d, *rest)


def _merge_dilation(x: Tensor, H: int, d: int) -> Tensor:
    """Inverse of :func:`_split_dilation`."""
    B, _, m = x.shape[:3]
    rest = x.shape[3:]
    return x.reshape(B, H, d, m, *rest).transpose(2, 3).reshape(B, H, m * d, *rest)


def global_index(global_mask: Tensor, g: int | None = None) -> tuple[Tensor, Tensor]:
    """``(B, n)`` bool -> ``idx (B, g)`` positions of the global tokens (ascending) and ``valid (B, g)``
    (rows with fewer global tokens are padded); ``g``: at least the largest count in the batch
    (default: that count, read from the device)."""
    counts = global_mask.sum(dim=1)                                           # (B,)
    if g is None:
        g = int(counts.max()) if global_mask.numel() else 0
    g = min(g, global_mask.shape[1])
    order = torch.sort((~global_mask).to(torch.int8), dim=1, stable=True).indices  # globals first, in order
    idx = order[:, :g]                                                        # (B, g)
    valid = torch.arange(g, device=idx.device).unsqueeze(0) < counts.unsqueeze(1)
    return idx, valid


def _take(x: Tensor, idx: Tensor) -> Tensor:
    """``x (B, H, n, e)``, ``idx (B, g)`` -> ``(B, H, g, e)``."""
    return x.gather(2, idx[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[-1]))


def longformer_attention(
    q: Tensor, k: Tensor, v: Tensor, window: int, *, causal: bool = False, dilation: int = 1,
    key_mask: Tensor | None = None, global_mask: Tensor | None = None,
    global_qkv: tuple[Tensor, Tensor, Tensor] | None = None, scale: float | None = None,
    max_global: int | None = None,
) -> Tensor:
    """Sliding-window attention with optional dilation and global tokens.

    Args:
        q, k, v: ``(B, H, n, e)`` local queries, keys, values.
        window: keys per side counting the query itself (``|p - j| < window·dilation``).
        causal: only keys ``j <= p``.
        dilation: gap ``d`` between the keys of a window.
        key_mask: ``(B, n)`` bool, ``False`` = padding (never attended).
        global_mask: ``(B, n)`` bool, ``True`` = global token.
        global_qkv: ``(q_g, k_g, v_g)``, each ``(B, H, n, e)``: the global projections of every
            token (only global rows of ``q_g`` are used); default ``(q, k, v)``.
        scale: default ``1/sqrt(e)``.
        max_global: an upper bound on any row's global tokens, known without reading the mask
            (the mixer's configured count); then nothing is read back from the device.
    Returns:
        ``(B, H, n, e)``.
    """
    B, H, n, e = q.shape
    scale = 1.0 / math.sqrt(e) if scale is None else scale
    key_ok = torch.ones(B, n, dtype=torch.bool, device=q.device) if key_mask is None else key_mask.bool()
    has_global = global_mask is not None and (bool(global_mask.any()) if max_global is None else max_global > 0)
    local_ok = key_ok & ~global_mask if has_global else key_ok               # a global key counts once
    step = window * dilation                                                 # pad n to whole dilated blocks
    pad = (-n) % step
    qp, kp, vp = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))              # (B, H, N, e)
    okp = F.pad(local_ok, (0, pad), value=False)[:, None].expand(B, H, -1)   # (B, H, N)
    qd, kd, vd, okd = (_split_dilation(t, dilation) for t in (qp, kp, vp, okp))  # (B, H·d, N/d, ...)
    scores, ok, span = window_scores(qd, kd, okd, window, causal, scale)     # (B, H·d, nb, c, L)
    if not has_global:
        out = torch.matmul(masked_softmax(scores, ok), span(vd))             # (B, H·d, nb, c, e)
        return _merge_dilation(out.flatten(2, 3), H, dilation)[:, :, :n]

    idx, valid = global_index(global_mask, max_global)                       # (B, g)
    out = _window_and_globals(qp, vd, scores, ok, span, k, v, idx, valid, key_ok, causal, dilation, scale)
    out = _merge_dilation(out.flatten(2, 3), H, dilation)[:, :, :n]          # (B, H, n, e)
    g_out = _global_rows(*(global_qkv or (q, k, v)), idx, key_ok, causal, scale)  # (B, H, g, e)
    dest = torch.where(valid, idx, n)                                        # padded rows go to a spare row
    out = F.pad(out, (0, 0, 0, 1)).scatter(2, dest[:, None, :, None].expand(-1, H, -1, e), g_out)
    return out[:, :, :n]


def _window_and_globals(qp, vd, scores, ok, span, k, v, idx, valid, key_ok, causal, dilation, scale):
    """Non-global rows: one softmax over each row's window keys and the ``g`` global keys.

    ``qp (B, H, N, e)`` padded queries; ``scores, ok (B, H·d, nb, c, L)`` the window part.
    Returns ``(B, H·d, nb, c, e)``.
    """
    B, H, N, _ = qp.shape
    kG, vG = _take(k, idx), _take(v, idx)                                    # (B, H, g, e)
    g_ok = (valid & key_ok.gather(1, idx))[:, None, None, :]                 # (B, 1, 1, g)
    if causal:
        pos = torch.arange(N, device=qp.device)
        g_ok = g_ok & (idx[:, None, None, :] <= pos[None, None, :, None])   # (B, 1, N, g)
    g_scores = torch.matmul(qp, kG.transpose(-1, -2)) * scale               # (B, H, N, g)
    gs, gok = (_split_dilation(t, dilation) for t in (g_scores, g_ok.expand(B, H, N, -1)))  # (B, H·d, N/d, g)
    nb, c = scores.shape[2], scores.shape[3]
    gs, gok = gs.view(*gs.shape[:2], nb, c, -1), gok.reshape(*gok.shape[:2], nb, c, -1)
    p = masked_softmax(torch.cat([scores, gs], -1), torch.cat([ok, gok], -1))
    p_local, p_global = p.split([scores.shape[-1], gs.shape[-1]], dim=-1)
    vGd = vG.repeat_interleave(dilation, dim=1).unsqueeze(2)                 # (B, H·d, 1, g, e)
    return torch.matmul(p_local, span(vd)) + torch.matmul(p_global, vGd)


def _global_rows(qg: Tensor, kg: Tensor, vg: Tensor, idx: Tensor, key_ok: Tensor, causal: bool,
                 scale: float) -> Tensor:
    """Global queries (rows ``idx (B, g)``) over every key with the global projections: ``(B, H, g, e)``."""
    n = kg.shape[2]
    ok = key_ok[:, None, None, :]                                             # (B, 1, 1, n)
    if causal:
        ok = ok & (torch.arange(n, device=kg.device)[None, None, None, :] <= idx[:, None, :, None])  # (B, 1, g, n)
    r = masked_softmax(torch.matmul(_take(qg, idx), kg.transpose(-1, -2)) * scale, ok)  # (B, H, g, n)
    return torch.matmul(r, vg)


def longformer_mask(n: int, window: int, *, causal: bool = False, dilation: int = 1,
                    global_mask: Tensor | None = None, device=None) -> Tensor:
    """The dense ``(B or 1, n, n)`` pattern of a non-global query (window ∪ global keys), for tests
    and explanations: what :func:`longformer_attention` computes without ever building it."""
    p = torch.arange(n, device=device).unsqueeze(1)
    j = torch.arange(n, device=device).unsqueeze(0)
    dist = p - j
    m = (dist.abs() < window * dilation) & (dist % dilation == 0)
    m = m.unsqueeze(0)
    if global_mask is not None:
        m = m | global_mask[:, None, :]
    return m & (dist >= 0) if causal else m
