"""The Mamba paper's synthetic tasks (Gu & Dao 2023, section 4.1) at CPU size, and a small trainer.

- Selective copying: ``K`` data tokens scattered at random among noise tokens in a region of length
  ``L``; after a "go" token the model writes them out in order. A time-invariant (LTI) layer cannot
  tell data from noise by content, only by position.
- Induction heads: a random sequence in which a special token is followed by a key token; the
  sequence ends with the special token again and the model must output the key token.
"""

from __future__ import annotations

import math
import time

import torch
from tqdm import tqdm

from tformer.config import TransformerConfig
from tformer.models import build_model

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


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only: not on ``A_log`` (it would pull A towards -1), D, Δ's bias,
    norms or biases (as the Mamba reference code does)."""
    decay, plain = [], []
    for name, p in model.named_parameters():
        (plain if p.dim() < 2 or name.endswith("A_log") else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]


def train(config: TransformerConfig, task, steps: int, batch: int, lr: float = 3e-3, seed: int = 0,
          desc: str = "", stop: tuple | None = None, max_seconds: float = float("inf")) -> tuple[torch.nn.Module, list[float], float, int]:
    """AdamW with a linear warm-up then cosine decay over ``steps`` on fresh batches from
    ``task(batch, g)``. ``stop = (ids, targets, every, level)``: every ``every`` steps measure
    :func:`accuracy` on that held-out set and stop once it reaches ``level``; stop too once
    ``max_seconds`` of training have passed (the schedule is still the one for ``steps``).
    Returns ``(model, losses, seconds, steps run)``."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    model = build_model(config).train()
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=lr, betas=(0.9, 0.98))
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    losses, start, held_out = [], time.perf_counter(), float("nan")
    bar = tqdm(range(steps), desc=desc, mininterval=10)
    for step in bar:
        ids, targets = task(batch, g=g)
        _, loss = model(ids, targets=targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if stop is not None and (step + 1) % stop[2] == 0:
            held_out = accuracy(model.eval(), stop[0], stop[1])
            model.train()
            if held_out >= stop[3]:
                break
        if time.perf_counter() - start > max_seconds:
            break
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}", acc=f"{held_out:.2f}", refresh=False)
    return model.eval(), losses, time.perf_counter() - start, len(losses)


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


def run_or_report(parser, run, report) -> None:
    """The experiments' command line: ``--report`` writes the table and plot from the saved runs,
    ``--model M`` trains one model and saves its run (so runs can go side by side)."""
    args = parser.parse_args()
    if args.report:
        report()
    elif args.model:
        run(args)
    else:
        parser.error("give --model or --report")
