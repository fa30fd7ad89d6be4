"""The language-modelling loss every model family shares."""

from __future__ import annotations

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


def token_loss(logits: Tensor, targets: Tensor, label_smoothing: float = 0.0) -> Tensor:
    """Mean cross-entropy of ``logits (B, T, V)`` against ``targets (B, T)``, skipping ``-100``, in fp32:
    ``(1 - ε) · (-log p_y) + ε · mean_v(-log p_v)`` with ``ε = label_smoothing`` (Szegedy et al.)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100,
                           label_smoothing=label_smoothing)
