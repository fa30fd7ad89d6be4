"""Learning-rate schedules by name: ``cosine`` (nanoGPT's, :func:`tformer.training.optim.lr_at`) and
``wsd`` (warm-up, stable, decay; Hägele et al. 2024, the modded-nanogpt speedrun's long cool-down).

    wsd:  lr·(s+1)/(w+1) for s < w,   lr until the cool-down starts at D - c·(D - w),
          then linear from lr to min_lr at D = decay_steps, min_lr after.

A long linear cool-down reaches a lower loss at the end than a cosine of the same length: the
stable phase explores at the full rate and the loss falls steeply while the rate goes to its floor.
"""

from __future__ import annotations

from tformer.training.optim import lr_at


def wsd_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, decay_steps: int,
           cooldown_fraction: float) -> float:
    """The ``wsd`` rate of the 0-based ``step``: warm-up as :func:`lr_at`, then ``lr`` until the last
    ``cooldown_fraction`` of the steps after warm-up, over which it falls linearly to ``min_lr`` (reached
    at ``decay_steps``)."""
    if step < warmup_steps:
        return lr * (step + 1) / (warmup_steps + 1)
    if step >= decay_steps:
        return min_lr
    cooldown = max(1, round(cooldown_fraction * (decay_steps - warmup_steps)))
    start = decay_steps - cooldown
    if step < start:
        return lr
    return lr + (min_lr - lr) * (step - start) / cooldown


def schedule_at(cfg, step: int) -> float:
    """The rate of ``step`` under ``cfg.schedule`` (a :class:`~tformer.training.config.TrainConfig`)."""
    kw = dict(lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=cfg.warmup_steps, decay_steps=cfg.decay_steps or cfg.max_steps)
    if cfg.schedule == "wsd":
        return wsd_at(step, cooldown_fraction=cfg.cooldown_fraction, **kw)
    return lr_at(step, **kw)
