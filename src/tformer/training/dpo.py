"""Preference losses on sequence log-probabilities: DPO (Rafailov et al., 2023) and its variants.

For a prompt ``x`` with a preferred answer ``y_w`` and a rejected one ``y_l``, the policy ``π`` and a
frozen reference ``π_ref`` (the model before training) give each answer's log-probability, the sum over
its tokens ``log π(y | x) = Σ_t log π(y_t | x, y_<t)`` (:func:`sequence_logps`). With the log-ratios
``ρ_w = log π(y_w|x) - log π_ref(y_w|x)``, ``ρ_l`` likewise, ``Δ = ρ_w - ρ_l`` and ``β`` the strength of
the pull towards the reference, the per-pair losses are (the batch's loss is their mean):

    sigmoid (DPO; cDPO with ε > 0)   -(1 - ε) · log σ(β Δ) - ε · log σ(-β Δ)
    robust  (rDPO, Chowdhury 2024)   (-(1 - ε) · log σ(β Δ) + ε · log σ(-β Δ)) / (1 - 2ε)
    ipo     (Azar 2023)              (ρ_w / n_w - ρ_l / n_l - 1 / (2β))²        n = the answer's tokens
    simpo   (Meng 2024; no reference) -(1 - ε) · log σ(β (m_w - m_l) - γ) - ε · log σ(γ - β (m_w - m_l))
                                     m = log π(y|x) / n, the mean per-token log-probability

``ε`` is the label smoothing (the share of pairs presumed mislabelled), ``γ`` SimPO's target margin. The
implicit rewards ``β ρ_w``, ``β ρ_l`` are what the reward accuracy counts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Tensor = torch.Tensor
IGNORE = -100
LOSSES = ("sigmoid", "robust", "ipo", "simpo")
REFERENCE_FREE = ("simpo",)


def sequence_logps(forward, ids: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """``(log π(answer), n)`` per row: the sum of ``log p(targets[b, t])`` over the labelled positions of
    row ``b`` and their count. ids, targets ``(R, T)``; ``forward`` a :class:`DecoderLM` (or its wrapper),
    whose head runs at the labelled positions only."""
    keep = targets != IGNORE                                                   # (R, T)
    logits, _ = forward(ids, targets, labelled_only=True)                      # (1, N, V), row-major order
    token = torch.log_softmax(logits[0].float(), dim=-1).gather(-1, targets[keep][:, None])[:, 0]   # (N,)
    rows = keep.nonzero()[:, 0]                                                # (N,) the row of each
    out = torch.zeros(ids.shape[0], dtype=token.dtype, device=token.device).index_add(0, rows, token)
    return out, keep.sum(1)


def preference_loss(chosen: Tensor, rejected: Tensor, ref_chosen: Tensor | None, ref_rejected: Tensor | None, *,
                    beta: float, kind: str = "sigmoid", label_smoothing: float = 0.0, n_chosen: Tensor | None = None,
                    n_rejected: Tensor | None = None, gamma: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """``(losses (B,), chosen_rewards (B,), rejected_rewards (B,))`` of the module docstring's ``kind``.

    chosen, rejected: the policy's sequence log-probabilities ``(B,)``; ref_*: the reference's (unused by
    ``simpo``); n_*: the answers' token counts (``ipo``, ``simpo``). Rewards are detached."""
    eps = label_smoothing
    if kind == "simpo":
        m_w, m_l = chosen / n_chosen.clamp(min=1), rejected / n_rejected.clamp(min=1)
        z = beta * (m_w - m_l) - gamma
        losses = -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
        return losses, beta * m_w.detach(), beta * m_l.detach()
    rho_w, rho_l = chosen - ref_chosen, rejected - ref_rejected
    z = beta * (rho_w - rho_l)
    if kind == "sigmoid":
        losses = -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
    elif kind == "robust":
        losses = (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)
    elif kind == "ipo":
        losses = (rho_w / n_chosen.clamp(min=1) - rho_l / n_rejected.clamp(min=1) - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown preference loss {kind!r}; choose one of {', '.join(LOSSES)}")
    return losses, beta * rho_w.detach(), beta * rho_l.detach()
