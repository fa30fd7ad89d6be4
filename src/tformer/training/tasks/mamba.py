"""The Mamba paper's synthetic tasks (Gu & Dao 2023, section 4.1) at CPU size, and their training run.

- Selective copying: ``K`` data tokens scattered at random among noise tokens in a region of length
  ``L``; after a "go" token the model writes them out in order. A time-invariant (LTI) layer cannot
  tell data from noise by content, only by position.
- Induction heads: a random sequence in which a special token is followed by a key token; the
  sequence ends with the special token again and the model must output the key token.

Training (:func:`train`) is the training loop on fresh batches: step s's batch comes from a
generator seeded with ``(seed, s)``.
"""

from __future__ import annotations

from typing import Callable

import torch

from tformer.config import TransformerConfig
from tformer.models import build_model
from tformer.training.config import TrainConfig
from tformer.training.loop import fit
from tformer.training.tasks.base import Task, step_generator

Tensor = torch.Tensor


def selective_copying(batch: int, L: int = 64, K: int = 8, n_data: int = 8, g: torch.Generator | None = None):
    """``(ids (batch, L + K), targets)``: a region of ``L`` tokens, noise 0 but for ``K`` data tokens
    (1..n_data) at random places, then a go token (n_data + 1) and the data tokens again, shifted:
    the model writes the data tokens out in order, each one after seeing the previous (teacher forcing,
    as in generation). The loss and accuracy are on those ``K`` outputs."""
    ids = torch.zeros(batch, L + K, dtype=torch.long)
    data = torch.randint(1, n_data + 1, (batch, K), generator=g)
    where = torch.rand(batch, L, generator=g).argsort(dim=1)[:, :K].sort(dim=1).values  # K positions, in order
    ids.scatter_(1, where, data)
    ids[:, L] = n_data + 1
    ids[:, L + 1:] = data[:, :-1]
    targets = torch.full_like(ids, -100)
    targets[:, L:] = data
    return ids, targets


def induction_heads(batch: int, T: int, n_tokens: int = 16, g: torch.Generator | None = None):
    """``(ids (batch, T), targets)``: tokens 1..n_tokens at random, the special token 0 once at a random
    place followed by a key, and again at the end; the loss is on the last position (the key)."""
    ids = torch.randint(1, n_tokens + 1, (batch, T), generator=g)
    key = torch.randint(1, n_tokens + 1, (batch,), generator=g)
    at = torch.randint(0, T - 3, (batch,), generator=g)
    rows = torch.arange(batch)
    ids[rows, at], ids[rows, at + 1], ids[:, -1] = 0, key, 0
    targets = torch.full_like(ids, -100)
    targets[:, -1] = key
    return ids, targets


def mamba_config(vocab: int, d: int = 64, n_layers: int = 2, context: int = 1 << 14, **options) -> TransformerConfig:
    return TransformerConfig(vocab_size=vocab, d_model=d, n_layers=n_layers, n_heads=1, mixer="mamba", ffn="none",
                             positions="none", norm="rmsnorm", bias=False, context_length=context,
                             mixer_options={"mamba": options})


def attention_config(vocab: int, d: int = 64, n_layers: int = 2, n_heads: int = 4, context: int = 1 << 14,
                     **kw) -> TransformerConfig:
    return TransformerConfig(vocab_size=vocab, d_model=d, n_layers=n_layers, n_heads=n_heads, positions="rope",
                             norm="rmsnorm", ffn="swiglu", bias=False, context_length=context,
                             attention_backend="torch", **kw)


@torch.no_grad()
def accuracy(model: torch.nn.Module, ids: Tensor, targets: Tensor, batch: int = 64) -> float:
    """Fraction of the target positions (``targets != -100``) whose argmax is right."""
    right = total = 0
    for i in range(0, len(ids), batch):
        logits, _ = model(ids[i:i + batch])
        t = targets[i:i + batch]
        keep = t != -100
        right += (logits.argmax(-1)[keep] == t[keep]).sum().item()
        total += keep.sum().item()
    return right / total


class Synthetic(Task):
    """Fresh batches of ``make(batch_size, g=...)`` each step; with ``held_out = (ids, targets)``,
    each evaluation measures :func:`accuracy` on it and the run ends once it reaches ``level``."""

    def __init__(self, make: Callable, batch_size: int, seed: int = 0, held_out: tuple | None = None,
                 level: float = 1.0):
        self.make, self.batch_size, self.seed, self.held_out, self.level = make, batch_size, seed, held_out, level

    def batch(self, step: int):
        return self.make(self.batch_size, g=step_generator(self.seed, step))      # (ids, targets), (B, T) each

    def loss(self, forward, batch) -> Tensor:
        ids, targets = batch
        return forward(ids, targets=targets)[1]

    def evaluate(self, loop) -> dict[str, float]:
        return {} if self.held_out is None else {"accuracy": accuracy(loop.model, *self.held_out)}

    def should_stop(self, metrics: dict[str, float]) -> bool:
        return metrics.get("accuracy", 0.0) >= self.level


def train(config: TransformerConfig, task: Callable, steps: int, batch: int, lr: float = 3e-3, seed: int = 0,
          desc: str = "", stop: tuple | None = None, max_seconds: float = 0.0) -> tuple[torch.nn.Module, list[float], float, int]:
    """The training loop on fresh batches from ``task(batch, g)``: AdamW (β = 0.9, 0.98; weight decay
    0.1 on matrices only, not on ``A_log``, ``D``, Δ's bias or norms), a linear warm-up over the first
    5% of ``steps`` then cosine decay to 0, clipping at 1. ``stop = (ids, targets, every, level)``: every
    ``every`` steps measure :func:`accuracy` on that held-out set and stop once it reaches ``level``;
    stop too after ``max_seconds`` of training (0 = no limit; the schedule is still the one for ``steps``).
    Returns ``(model, losses of every step, seconds, steps run)``."""
    torch.manual_seed(seed)
    model = build_model(config)
    settings = TrainConfig(max_steps=steps, batch_size=batch, lr=lr, min_lr=0.0, warmup_steps=max(1, steps // 20),
                           weight_decay=0.1, beta1=0.9, beta2=0.98, grad_clip=1.0, precision="fp32", device="cpu",
                           seed=seed, eval_interval=stop[2] if stop else steps, log_interval=1,
                           time_limit=max_seconds, progress=True)
    work = Synthetic(task, batch, seed, held_out=stop[:2] if stop else None, level=stop[3] if stop else 1.0)

    def bar(total, initial):
        from tqdm import tqdm
        return tqdm(total=total, initial=initial, desc=desc, mininterval=10)

    model, summary = fit(model, work, settings, progress=bar, log=lambda message: None)
    losses = [r["loss"] for r in summary["history"] if "loss" in r]
    return model, losses, summary["elapsed_s"], len(losses)
