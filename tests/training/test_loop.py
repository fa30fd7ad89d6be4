"""The one training loop (training/loop.py) on a generic task, against an independent reference: a
plain PyTorch loop written out here (AdamW, warm-up + cosine by its closed form, clipping by the total
norm computed by hand). Also: a non-finite loss stops before the update, the task's target ends the run,
and a task-agnostic exact resume (k steps + resume + k steps = 2k steps, fp32)."""

import math

import numpy as np
import pytest
import torch
import torch.nn as nn

from tformer.checkpoint import resolve_checkpoint
from tformer.config import TransformerConfig
from tformer.models import build_model
from tformer.training.config import TrainConfig
from tformer.training.data import get_batch
from tformer.training.loop import Loop, fit
from tformer.training.runs import load_training_state
from tformer.training.tasks.base import Task, step_generator


class Regression(Task):
    """y = x·w* + noise, 8 rows a step drawn from (seed, step); mean squared error."""

    def __init__(self, nan_at: int | None = None):
        self.w = torch.linspace(-1, 1, 6)
        self.nan_at = nan_at
        self.tokenizer = self

    def batch(self, step: int):
        g = step_generator(0, step)
        x = torch.randn(8, 6, generator=g)
        return x, x @ self.w + 0.1 * torch.randn(8, generator=g)

    def loss(self, forward, batch):
        x, y = batch
        loss = ((forward(x).squeeze(-1) - y) ** 2).mean()
        return loss * math.nan if self.nan_at is not None and self._step == self.nan_at else loss

    def pieces(self, step, dist):
        self._step = step
        return super().pieces(step, dist)

    def save(self, path):                     # the "tokenizer" every checkpoint holds
        open(path, "w").write("{}")


class Linear(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(6, 1)

    def forward(self, x):
        return self.proj(x)


SETTINGS = dict(max_steps=12, lr=0.05, min_lr=0.005, warmup_steps=3, weight_decay=0.1, beta1=0.9, beta2=0.95,
                grad_clip=0.5, precision="fp32", device="cpu", eval_interval=4, log_interval=1, progress=False)


def _reference(steps: int) -> nn.Module:
    """The same run written out by hand."""
    model, task = Linear(), Regression()
    opt = torch.optim.AdamW([{"params": [model.proj.weight], "weight_decay": 0.1},
                             {"params": [model.proj.bias], "weight_decay": 0.0}], lr=0.05, betas=(0.9, 0.95),
                            foreach=False, fused=False)
    for step in range(steps):
        if step < 3:
            lr = 0.05 * (step + 1) / 4
        else:
            lr = 0.005 + 0.5 * (1 + math.cos(math.pi * (step - 3) / (12 - 3))) * (0.05 - 0.005)
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = task.batch(step)
        loss = ((model(x).squeeze(-1) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        norm = math.sqrt(sum(float((p.grad ** 2).sum()) for p in model.parameters()))
        if norm > 0.5:
            for p in model.parameters():
                p.grad *= 0.5 / (norm + 1e-6)
        opt.step()
    return model


def test_the_loop_equals_a_plain_adamw_loop_written_out(one_thread):
    model, summary = fit(Linear(), Regression(), TrainConfig(**SETTINGS), log=lambda m: None)
    ref = _reference(12)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert [r["step"] for r in summary["history"]] == list(range(1, 13)) and summary["stopped"] is None
    assert summary["history"][0]["lr"] == pytest.approx(0.05 / 4)


def test_a_nonfinite_loss_stops_before_its_update(one_thread):
    model, summary = fit(Linear(), Regression(nan_at=5), TrainConfig(**SETTINGS), on_nonfinite="stop",
                         log=lambda m: None)
    ref = _reference(5)                                      # steps 0..4 done, step 5 not applied
    assert summary["stopped"] == "nonfinite" and len(summary["history"]) == 5
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="loss became nan at step 6"):
        fit(Linear(), Regression(nan_at=5), TrainConfig(**SETTINGS), log=lambda m: None)


def test_the_task_target_ends_the_run():
    class Target(Regression):
        def evaluate(self, loop):
            return {"val_loss": 1.0 / loop.step}

        def should_stop(self, metrics):
            return metrics["val_loss"] < 0.2                  # reached at the evaluation of step 8

    _, summary = fit(Linear(), Target(), TrainConfig(**SETTINGS), log=lambda m: None)
    assert summary["stopped"] == "done" and summary["step"] == 8


class Windows(Task):
    """Next-token prediction on random windows of a fixed token stream (a library model, so it checkpoints)."""

    def __init__(self):
        self.data = np.arange(400, dtype=np.uint16) % 13
        self.tokenizer = Regression()                      # anything with save(path)

    def batch(self, step: int):
        return get_batch(self.data, 4, 8, (0, step))

    def loss(self, forward, batch):
        x, y = batch
        return forward(x, targets=y)[1]


def _decoder():
    torch.manual_seed(0)
    return build_model(TransformerConfig(vocab_size=13, context_length=8, n_layers=1, d_model=16, n_heads=2,
                                         dropout=0.1))


def test_resume_of_any_task_is_exact(tmp_path, one_thread):
    """6 steps + resume + 6 steps = 12 steps bit for bit (dropout on: the RNG is in the checkpoint)."""
    settings = {**SETTINGS, "decay_steps": 12}
    whole = Loop(_decoder(), Windows(), TrainConfig(**settings), out_dir=tmp_path / "a", log=lambda m: None)
    whole.fit()
    Loop(_decoder(), Windows(), TrainConfig(**{**settings, "max_steps": 6, "eval_interval": 6}),
         out_dir=tmp_path / "b", log=lambda m: None).fit()
    folder = resolve_checkpoint(tmp_path / "b")
    state, opt_state = load_training_state(folder)
    again = Loop(_decoder(), Windows(), TrainConfig(**settings), out_dir=tmp_path / "b", log=lambda m: None)
    again.resume(folder, state, opt_state)
    assert again.step == 6
    again.fit()
    for a, b in zip(whole.model.parameters(), again.model.parameters()):
        assert torch.equal(a, b)


def test_another_ranks_stop_request_makes_this_rank_save_too(tmp_path, one_thread):
    """Under torchrun the stop signal reaches the ranks at slightly different moments. When the other
    rank's request arrives through the agreement at the top of a step, before this rank's own signal,
    this rank must stop *and save* with it (the save is collective): the defect was that it left the
    loop without saving, so the other rank waited for it in the checkpoint's collectives until torchrun
    killed both. One process stands in for the pair: its agreement reports the other rank's request at
    the top of step 3 (agree is called at the top and at the bottom of every step)."""
    loop = Loop(_decoder(), Windows(), TrainConfig(**{**SETTINGS, "eval_interval": 100}), out_dir=tmp_path / "r",
                log=lambda m: None)
    calls = []

    def agree(why):
        calls.append(why)
        return "term" if len(calls) == 7 else why           # call 7 = the top of step 3

    loop.dist.agree = agree
    summary = loop.fit()
    assert summary["stopped"] == "term" and summary["step"] == 3
    assert load_training_state(resolve_checkpoint(tmp_path / "r"))[0]["step"] == 3   # saved where it stopped
