"""Fine-tuning a pretrained decoder on examples ``(ids, labels)`` (:mod:`tformer.training.chat_data`):
padded batches, the loss on labelled tokens only, the held-out loss and (for chat tasks with a
reference answer) the held-out exact match of greedy answers.

Step s's batch is ``batch_size`` training examples drawn with the generator of ``(seed, s)``, right-
padded to the longest: inputs ``ids[:-1]`` (padding = ``pad_id``), targets ``labels[1:]`` (padding =
-100). A causal model's real tokens never attend to the padding after them, so no mask is needed.

The loss is the mean cross-entropy over the labelled targets only, so a decoder runs its final norm
and LM head (``d_model x vocab``, 49,152 words for SmolLM2: a fifth of its forward FLOPs) only at
those positions (``labelled_only``); the chat numbers task labels about a fifth of its tokens.
"""

from __future__ import annotations

import hashlib
import json

import torch

from tformer.generation.generate import generate
from tformer.training.chat_data import IGNORE, encode
from tformer.training.shared_prefix import can_share, prefix_shared_loss
from tformer.training.tasks.base import Task, step_generator


def pad_batch(examples: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """``{"ids": (B, T), "targets": (B, T)}``, ``T`` = the longest example less one token."""
    T = max(len(ids) for ids, _ in examples) - 1
    ids = torch.full((len(examples), T), pad_id, dtype=torch.long)
    targets = torch.full((len(examples), T), IGNORE, dtype=torch.long)
    for row, (x, y) in enumerate(examples):
        ids[row, :len(x) - 1] = torch.tensor(x[:-1])
        targets[row, :len(y) - 1] = torch.tensor(y[1:])
    return {"ids": ids, "targets": targets}


class FinetuneTask(Task):
    """Args:
        train, val: examples; ``val`` gives ``val_loss`` (its first ``eval_batches · batch_size``).
        questions: held-out ``(prompt ids, reference answer)`` pairs scored by greedy exact match
            (``exact_match``) at each evaluation; empty = none.
        stop_ids: tokens that end an answer (the template's end-of-turn, EOS).
        decode: ids -> text.
        labelled_only: the model's forward takes ``labelled_only`` (a
            :class:`~tformer.models.decoder.DecoderLM`): the head runs at labelled positions only.
        share_prefix: with ``labelled_only``, run the tokens every row of a batch begins with once
            (:mod:`tformer.training.shared_prefix`; used only where the model allows it exactly).
    """

    eval_at_start = True

    def __init__(self, train: list, val: list, cfg, tokenizer, pad_id: int, questions: list | None = None,
                 stop_ids: tuple[int, ...] = (), decode=None, labelled_only: bool = False,
                 share_prefix: bool = False):
        self.train, self.val, self.cfg, self.tokenizer, self.pad_id = train, val, cfg, tokenizer, pad_id
        self.questions, self.stop_ids, self.decode = questions or [], tuple(stop_ids), decode or tokenizer.decode
        self.labelled_only, self.share_prefix = labelled_only, share_prefix and labelled_only
        mean = sum(len(x) - 1 for x, _ in train) / len(train)
        self.tokens_per_step = round(cfg.batch_size * mean)       # the mean: batches differ in length
        # greedy answers stop after the longest reference answer's tokens and a few more (a longer one is wrong)
        self.answer_tokens = 4 + max((len(encode(tokenizer, ref)) for _, ref in self.questions), default=44)
        self.fingerprint = hashlib.sha256(json.dumps([train, val]).encode()).hexdigest()[:16]

    def batch(self, step: int) -> dict:
        idx = torch.randint(len(self.train), (self.cfg.batch_size,), generator=step_generator(self.cfg.seed, step))
        return pad_batch([self.train[i] for i in idx.tolist()], self.pad_id)

    def loss(self, forward, batch) -> torch.Tensor:
        if self.share_prefix and can_share(forward):       # the plain model (not DDP / compiled)
            return prefix_shared_loss(forward, batch["ids"], batch["targets"], self.pad_id)
        if self.labelled_only:
            return forward(batch["ids"], batch["targets"], labelled_only=True)[1]
        return forward(batch["ids"], batch["targets"])[1]

    def evaluate(self, loop) -> dict[str, float]:
        out = {}
        if self.val:
            val = self.val[: self.cfg.eval_batches * self.cfg.batch_size]
            total = count = 0
            for i in range(0, len(val), self.cfg.batch_size):
                b = pad_batch(val[i:i + self.cfg.batch_size], self.pad_id)
                n = int((b["targets"] != IGNORE).sum())
                with torch.autocast(loop.device.split(":")[0], dtype=torch.bfloat16,
                                    enabled=loop.dtype == torch.bfloat16):
                    total += float(self.loss(loop.forward, {k: v.to(loop.device) for k, v in b.items()})) * n
                count += n
            out["val_loss"] = total / max(count, 1)
        if self.questions:
            out["exact_match"] = exact_match(loop.model, self.questions, self.stop_ids, self.decode,
                                             self.pad_id, loop.device, self.answer_tokens)
        return out

    def state(self) -> dict:
        return {"corpus_fingerprint": self.fingerprint}


@torch.no_grad()
def answers(model, prompts: list[list[int]], stop_ids: tuple[int, ...], decode, pad_id: int, device: str = "cpu",
            max_new_tokens: int = 48, batch_size: int = 32) -> list[str]:
    """Greedy answers to ``prompts`` (left-padded batches), cut at the first stop token."""
    out = []
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i:i + batch_size]
        T = max(map(len, chunk))
        ids = torch.full((len(chunk), T), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), T), dtype=torch.long)
        for r, p in enumerate(chunk):
            ids[r, T - len(p):], mask[r, T - len(p):] = torch.tensor(p), 1
        new = generate(model, ids.to(device), max_new_tokens, attention_mask=mask.to(device), temperature=0.0,
                       stop_tokens=stop_ids, pad_id=pad_id)[:, T:].tolist()
        for row in new:
            cut = next((j for j, t in enumerate(row) if t in stop_ids), len(row))
            out.append(decode(row[:cut]).strip())
    return out


def exact_match(model, questions: list, stop_ids, decode, pad_id: int, device: str = "cpu",
                max_new_tokens: int = 48) -> float:
    """Share of ``(prompt ids, reference)`` whose greedy answer is the reference exactly (stripped);
    an answer longer than ``max_new_tokens`` tokens is cut there (and so wrong)."""
    got = answers(model, [p for p, _ in questions], stop_ids, decode, pad_id, device, max_new_tokens)
    return sum(g == ref.strip() for g, (_, ref) in zip(got, questions)) / len(questions)
