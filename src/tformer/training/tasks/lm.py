"""Language modelling on a tokenised corpus (``tformer train``): next-token cross-entropy on random
windows, the train and validation losses at each evaluation, and a sample of text after it.

Step s's global batch is ``grad_accum`` micro-batches of ``batch_size`` windows of ``T + 1``
tokens, micro-batch m drawn with the seed ``(seed, 0, s, m)``; under torchrun each rank takes its
rows of it (:meth:`tformer.training.distributed.Distributed.batches`).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from tformer.training.config import TrainConfig
from tformer.training.data import Corpus, get_batch
from tformer.training.tasks.base import Task

# Evaluation stacks its fixed batches into forwards of up to this many tokens: fewer, larger products, while a
# pass's activations still fit the caches: at nanoGPT's CPU configuration this measured faster than passes of
# one batch and than one pass of all 15,360 tokens (docs/training.md#how-the-cpu-training-step-is-made-fast).
EVAL_TOKENS_PER_PASS = 4096


class LanguageModelling(Task):
    """Next-token prediction on ``corpus`` with windows of ``context_length`` tokens.

    Args:
        sampler: called on every rank after each evaluation; the text it returns is shown (rank 0).
    """

    eval_at_start = True

    def __init__(self, corpus: Corpus, cfg: TrainConfig, context_length: int, flops_per_token: float = 0.0,
                 preset: str = "tiny", sampler: Callable[[], str] | None = None):
        self.corpus, self.cfg, self.T, self.preset, self.sampler = corpus, cfg, context_length, preset, sampler
        self.tokenizer = corpus.tokenizer
        self.tokens_per_step = cfg.batch_size * cfg.grad_accum * context_length   # the global batch, all ranks
        self.flops_per_token = flops_per_token

    def pieces(self, step: int, dist):
        cfg = self.cfg
        for last, x, y, share in dist.batches(self.corpus.train, cfg.batch_size, cfg.grad_accum, self.T,
                                              (cfg.seed, 0, step)):
            yield last, (x, y), share

    def loss(self, forward, batch) -> torch.Tensor:
        x, y = batch                                       # (B, T) each
        return forward(x, y)[1]

    def evaluate(self, loop) -> dict[str, float]:
        """Mean loss over ``eval_batches`` fixed batches of each split (the same batches every time)."""
        cfg, T, dist = self.cfg, self.T, loop.dist
        out = {}
        share = list(dist.eval_share(cfg.eval_batches))                     # (k, weight); every k in one process
        per_pass = max(1, EVAL_TOKENS_PER_PASS // (cfg.batch_size * T))      # batches stacked into one forward
        for i, (name, data) in enumerate((("train", self.corpus.train), ("val", self.corpus.val))):
            total = 0.0
            for c in range(0, len(share), per_pass):
                chunk = share[c:c + per_pass]
                xs, ys = zip(*(get_batch(data, cfg.batch_size, T, (cfg.seed, 1 + i, k)) for k, _ in chunk))
                with torch.autocast(loop.device.split(":")[0], dtype=torch.bfloat16,
                                    enabled=loop.dtype == torch.bfloat16):
                    logits, _ = loop.forward(torch.cat(xs).to(loop.device))   # (len(chunk)·batch, T, vocab)
                losses = F.cross_entropy(logits.flatten(0, 1).float(), torch.cat(ys).to(loop.device).flatten(),
                                         reduction="none")                     # (len(chunk)·batch·T,)
                batch_means = losses.view(len(chunk), -1).mean(1)       # equal-sized batches: one mean each
                total += float(sum(w * m for (_, w), m in zip(chunk, batch_means.tolist())))
            out[f"{name}_loss"] = dist.sum(total) / cfg.eval_batches
        return out

    def report(self, step: int, metrics: dict[str, float]) -> list[str]:
        lines = [f"step {step}: train loss {metrics['train_loss']:.4f}, val loss {metrics['val_loss']:.4f}"]
        if self.cfg.sample_tokens and self.sampler is not None:
            text = self.sampler()                          # every rank calls it (FSDP gathers the weights)
            lines.append("  | " + "\n  | ".join(text.splitlines()[:8]))
        return lines

    def should_stop(self, metrics: dict[str, float]) -> bool:
        """``target_loss`` reached: the val loss is at most it (never when it is 0)."""
        return self.cfg.target_loss > 0 and metrics.get("val_loss", float("inf")) <= self.cfg.target_loss

    def state(self) -> dict:
        return {"preset": self.preset, "corpus_fingerprint": self.corpus.fingerprint}
