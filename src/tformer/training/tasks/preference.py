"""Preference tuning (DPO and its variants, :mod:`tformer.training.dpo`) on pairs of chat examples.

A pair is ``(chosen, rejected)``, each an example ``(ids, labels)`` labelled on its answer. Step s's batch
is ``batch_size`` pairs drawn with the generator of ``(seed, s)``: one padded batch of ``2B`` rows, the B
chosen answers then the B rejected ones (:func:`~tformer.training.tasks.finetune.pad_batch`), so one forward
gives every sequence log-probability.

The reference's log-probabilities are computed once, before the first step, for every pair (the model as
it starts: the base, since LoRA's ``B`` starts at zero, or the untrained weights of a full fine-tuning),
and kept in the run's state: no second model is held, and resume reads them back rather than computing them
from a model that has since moved.

Each evaluation reports, on the held-out pairs: ``pref_accuracy``, the share whose chosen answer the
model gives a higher log-probability than the rejected one (the model alone, so the base model has a value
too); ``reward_accuracy``, the share whose implicit reward margin ``β (ρ_w - ρ_l)`` is positive (0 before
training: every margin is 0); and ``val_loss``, the preference loss.
"""

from __future__ import annotations

import hashlib
import json

import torch

from tformer.training.dpo import REFERENCE_FREE, preference_loss, sequence_logps
from tformer.training.tasks.base import Task, step_generator
from tformer.training.tasks.finetune import pad_batch


class PreferenceTask(Task):
    """Args:
        train, val: pairs ``((ids, labels) chosen, (ids, labels) rejected)``.
        cfg: settings with ``batch_size``, ``seed``, ``eval_batches``, ``dpo_beta``, ``dpo_loss``,
            ``label_smoothing``, ``simpo_gamma``.
        reference: ``{"train": [[chosen, rejected], ...], "val": [...]}`` log-probabilities from an earlier
            run's state, or ``None`` (computed by :meth:`compute_reference` before training).
    """

    eval_at_start = True

    def __init__(self, train: list, val: list, cfg, tokenizer, pad_id: int, stop_ids: tuple[int, ...] = (),
                 reference: dict[str, list] | None = None):
        self.train, self.val, self.cfg, self.tokenizer, self.pad_id = train, val, cfg, tokenizer, pad_id
        self.stop_ids, self.questions = tuple(stop_ids), []
        self.reference = reference
        mean = sum(len(c[0]) + len(r[0]) - 2 for c, r in train) / len(train)
        self.tokens_per_step = round(cfg.batch_size * mean)
        self.fingerprint = hashlib.sha256(json.dumps([train, val]).encode()).hexdigest()[:16]
        self.free = cfg.dpo_loss in REFERENCE_FREE

    # ------------------------------------------------------------------ the reference
    @torch.no_grad()
    def compute_reference(self, model, device: str = "cpu", dtype=torch.float32) -> None:
        """Every pair's reference log-probabilities, from ``model`` as it is now (eval mode, no autocast
        unless ``dtype`` is bf16: the policy's own precision, so the first step's margins start at 0)."""
        was = model.training
        model.eval()
        try:
            self.reference = {name: self._logps(model, pairs, device, dtype) for name, pairs in
                              (("train", self.train), ("val", self.val))}
        finally:
            model.train(was)

    def _logps(self, forward, pairs, device, dtype) -> list[list[float]]:
        out = []
        for i in range(0, len(pairs), self.cfg.batch_size):
            chunk = pairs[i:i + self.cfg.batch_size]
            b = self._rows(chunk)
            with torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                lp, _ = sequence_logps(forward, b["ids"].to(device), b["targets"].to(device))
            lp = lp.cpu()
            out += [[float(lp[j]), float(lp[len(chunk) + j])] for j in range(len(chunk))]
        return out

    def _rows(self, pairs) -> dict:
        return pad_batch([c for c, _ in pairs] + [r for _, r in pairs], self.pad_id)

    # ------------------------------------------------------------------ the loop's hooks
    def batch(self, step: int) -> dict:
        idx = torch.randint(len(self.train), (self.cfg.batch_size,), generator=step_generator(self.cfg.seed, step))
        b = self._rows([self.train[i] for i in idx.tolist()])
        if not self.free:
            b["ref"] = torch.tensor([self.reference["train"][i] for i in idx.tolist()], dtype=torch.float32)  # (B, 2)
        return b

    def loss(self, forward, batch) -> torch.Tensor:
        return self._pair_losses(forward, batch)[0].mean()

    def _pair_losses(self, forward, batch):
        cfg = self.cfg
        lp, n = sequence_logps(forward, batch["ids"], batch["targets"])            # (2B,), (2B,)
        B = lp.shape[0] // 2
        ref = batch.get("ref")
        losses, r_w, r_l = preference_loss(
            lp[:B], lp[B:], ref[:, 0] if ref is not None else None, ref[:, 1] if ref is not None else None,
            beta=cfg.dpo_beta, kind=cfg.dpo_loss, label_smoothing=cfg.label_smoothing, n_chosen=n[:B],
            n_rejected=n[B:], gamma=cfg.simpo_gamma)
        return losses, lp[:B].detach(), lp[B:].detach(), r_w, r_l

    @torch.no_grad()
    def evaluate(self, loop) -> dict[str, float]:
        val = self.val[: self.cfg.eval_batches * self.cfg.batch_size]
        if not val:
            return {}
        loss = pref = reward = 0.0
        for i in range(0, len(val), self.cfg.batch_size):
            chunk = val[i:i + self.cfg.batch_size]
            b = self._rows(chunk)
            if not self.free:
                b["ref"] = torch.tensor(self.reference["val"][i:i + len(chunk)], dtype=torch.float32)
            b = {k: v.to(loop.device) for k, v in b.items()}
            with torch.autocast(loop.device.split(":")[0], dtype=torch.bfloat16, enabled=loop.dtype == torch.bfloat16):
                losses, lp_w, lp_l, r_w, r_l = self._pair_losses(loop.forward, b)
            loss += float(losses.sum())
            pref += float((lp_w > lp_l).sum())
            reward += float((r_w > r_l).sum())
        n = len(val)
        return {"val_loss": loss / n, "pref_accuracy": pref / n, "reward_accuracy": reward / n}

    def state(self) -> dict:
        return {"corpus_fingerprint": self.fingerprint, "reference_logps": self.reference}
