"""AdamW with weight decay on matrices only, and the learning-rate schedule."""

from __future__ import annotations

import math

import torch

from tformer.nn.markers import decays


def make_optimizer(model: torch.nn.Module, lr: float, betas: tuple[float, float], weight_decay: float,
                   device_type: str = "cpu") -> torch.optim.AdamW:
    """AdamW; matrices (embeddings, Linear weights) decay; vectors (biases, norm gains) and parameters
    marked :func:`~tformer.nn.markers.no_weight_decay` (Mamba's ``A_log`` and ``D``) do not.

    Uses the fused kernel where PyTorch has one for the device (CPU and CUDA in recent releases),
    else the foreach one.
    """
    groups = param_groups(model, weight_decay)
    try:
        return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=True)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(groups, lr=lr, betas=betas, foreach=True)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: what decays (by :func:`~tformer.nn.markers.decays`) and what does not."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]   # a tied matrix appears once
    return [
        {"params": [p for n, p in named if decays(n, p)], "weight_decay": weight_decay},
        {"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0},
    ]


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, decay_steps: int) -> float:
    """Linear warmup from ~0 to ``lr`` over ``warmup_steps``, cosine decay to ``min_lr`` at ``decay_steps``.

    ``step`` is 0-based (the learning rate of the ``step``-th update); past ``decay_steps`` it stays at ``min_lr``.
    """
    if step < warmup_steps:
        return lr * (step + 1) / (warmup_steps + 1)
    if step >= decay_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, decay_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)
