"""Logit soft-capping: ``cap · tanh(z / cap)`` (Gemma 2; the modded-nanogpt speedrun).

Near zero it is the identity (tanh(u) ≈ u), and it never leaves ``(-cap, cap)``: the head cannot
make one logit arbitrarily confident, which keeps the loss's gradient from being dominated by a few
over-confident tokens early in training. Its derivative is ``1 - tanh²(z / cap)``.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def softcap(logits: Tensor, cap: float) -> Tensor:
    """``cap · tanh(logits / cap)`` elementwise (any shape); ``cap <= 0`` returns ``logits`` unchanged."""
    if cap <= 0:
        return logits
    return cap * torch.tanh(logits / cap)
