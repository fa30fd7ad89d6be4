"""What a task gives the training loop (:mod:`tformer.training.loop`): the batches of each step and
the loss of one batch. Everything else (optimiser, schedule, precision, clipping, checkpoints,
resume, signals, progress) is the loop's.

A step's batch must be a function of the step alone (draw it from a generator seeded with
``(seed, step)``, never from a generator carried across steps), so that a resumed run sees the
same batches as an uninterrupted one.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import torch


class Task:
    """The base of every task. Subclasses give :meth:`batch` (one process) or :meth:`pieces`
    (several ranks), and :meth:`loss`; the other hooks are optional.

    Attributes:
        tokenizer: saved into each checkpoint as ``tokenizer.json`` (anything with ``save(path)``);
            needed only when the loop writes checkpoints.
        tokens_per_step: tokens of one step's global batch, for the throughput in the log (0 = none).
        flops_per_token: training FLOPs per token, for MFU in the log (0 = none).
        eval_at_start: evaluate once before the first step of a new run.
    """

    tokenizer: Any = None
    tokens_per_step: int = 0
    flops_per_token: float = 0.0
    eval_at_start: bool = False

    def batch(self, step: int) -> Any:
        """The whole batch of step ``step`` (tensors, or a tuple/dict of them)."""
        raise NotImplementedError

    def pieces(self, step: int, dist) -> Iterator[tuple[bool, Any, float]]:
        """This rank's pieces of step ``step``'s batch: ``(last, batch, share)``; the loop
        back-propagates ``loss / share`` of each piece (see :mod:`tformer.training.distributed`).
        The default is one piece, the whole :meth:`batch`, for one process."""
        if dist.active:
            raise NotImplementedError(f"{type(self).__name__} trains in one process only")
        yield True, self.batch(step), 1.0

    def loss(self, forward, batch) -> torch.Tensor:
        """The scalar mean loss of ``batch`` (already on the loop's device) through ``forward``."""
        raise NotImplementedError

    def evaluate(self, loop) -> dict[str, float]:
        """Held-out measurements at each evaluation (``val_loss`` is tracked as the best); ``{}`` = none.
        The loop puts the model in eval mode around this call."""
        return {}

    def report(self, step: int, metrics: dict[str, float]) -> list[str]:
        """Lines to print after an evaluation."""
        return [f"step {step}: " + ", ".join(f"{k.replace('_', ' ')} {v:.4f}" for k, v in metrics.items())]

    def should_stop(self, metrics: dict[str, float]) -> bool:
        """Whether an evaluation's result ends the run early (e.g. a target accuracy reached)."""
        return False

    def state(self) -> dict:
        """JSON-able facts saved with each checkpoint's trainer state (e.g. the data's fingerprint)."""
        return {}


def step_generator(seed: int, step: int) -> torch.Generator:
    """A torch generator seeded from ``(seed, step)`` alone (so a resumed run draws the same batches)."""
    return torch.Generator().manual_seed(int(np.random.SeedSequence([seed, step]).generate_state(1)[0]))


def to_device(batch: Any, device: str) -> Any:
    """``batch`` with every tensor in it (nested in tuples, lists, dicts) moved to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch
