"""The training loop every task runs: a task's batches and loss -> optimiser step, with the schedule,
precision, clipping, evaluation, checkpoints, exact resume, SIGTERM save, the run lock and progress.

    for step in range(start, max_steps):
        lr = schedule_at(cfg, step)                      the run's schedule: wsd or cosine (schedule.py)
        for (last, batch, share) in task.pieces(step):  this rank's share of the step's batch
            loss = task.loss(forward, batch) under autocast;  (loss / share).backward()
        mean loss of the global batch not finite -> stop before the update (the model stays good)
        clip gradients -> optimiser step                 AdamW, or Muon + AdamW (optim.py)
        every log_interval: progress bar + metrics.jsonl;  every eval_interval: task.evaluate, save

Exact resume: a task draws the batch of step s from a generator seeded with (seed, s), the learning
rate is a function of s, and a checkpoint stores the weights, the optimizer state and the torch RNG;
so k steps + resume + k steps repeat 2k steps bit for bit (fp32).

Without ``out_dir`` (claims' toy runs, the synthetic-task benchmarks) nothing is written: no lock,
no metrics file, no checkpoint, and Ctrl-C / SIGTERM keep their default effect (there is nothing to save).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch

from tformer.errors import ConfigError
from tformer.exits import STOP_SIGNALS
from tformer.machine import bf16_supported
from tformer.ops import activation_cpu, attention_cpu
from tformer.training import dist_checkpoint, distributed
from tformer.training.checkpointing import enable_checkpointing
from tformer.training.config import AUTO_BF16_MIN_WIDTH, TrainConfig
from tformer.training.optim import build_optimizer
from tformer.training.schedule import schedule_at
from tformer.training.runlock import RunLock
from tformer.training.tasks.base import Task, to_device


class Stop(Exception):
    """Raised inside the loop to end the run early (a signal, the time limit, the task's target)."""


def resolve_dtype(precision: str, device: str, width: int) -> torch.dtype:
    """The autocast dtype of ``precision``: ``auto`` is bf16 where the hardware has it and, on CPU,
    the model is at least :data:`AUTO_BF16_MIN_WIDTH` wide (where it measured faster); else fp32."""
    use = precision == "bf16" or (precision == "auto" and bf16_supported(device)
                                  and (device != "cpu" or width >= AUTO_BF16_MIN_WIDTH))
    return torch.bfloat16 if use else torch.float32


class Loop:
    """One training run of ``model`` on ``task`` with the settings ``cfg``; call :meth:`fit`.

    Args:
        model: the module to train (moved to the run's device; built by the caller after seeding).
        task: its batches and loss (:class:`~tformer.training.tasks.base.Task`).
        cfg: a :class:`TrainConfig` (or a subclass): the loop reads the optimiser, schedule,
            precision, clipping, interval, time-limit, device and distributed fields.
        out_dir: the run folder (checkpoints, metrics.jsonl, lock); ``None`` = write nothing.
        on_nonfinite: ``"raise"`` (a ConfigError naming the step) or ``"stop"`` (end the run, the
            model as it was before that step; the summary's ``stopped`` is ``"nonfinite"``).
        progress: ``progress(total, initial)`` -> a tqdm-like bar; default tqdm when ``cfg.progress``.
        resume_hint: the command that continues the run, named when it stops early.
    """

    def __init__(self, model: torch.nn.Module, task: Task, cfg: TrainConfig, *, out_dir: str | Path | None = None,
                 log=print, on_nonfinite: str = "raise", progress=None, resume_hint: str | None = None):
        self.cfg, self.task, self.log = cfg, task, log
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.on_nonfinite, self.make_bar = on_nonfinite, progress
        self.resume_hint = resume_hint or (f"tformer train --resume --out {self.out_dir}" if self.out_dir else "")
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.dist = distributed.setup(cfg.device, cfg.dist_timeout)     # one process, or a rank under torchrun
        device = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
        self.device = self.dist.place(device)
        self.model = model.to(self.device)
        if cfg.checkpointing:                     # before DDP / FSDP wrap the blocks
            enable_checkpointing(self.model, trim_heap=cfg.trim_heap)
        self.forward = self.dist.wrap(self.model, cfg.strategy, self.device)   # the model, DDP, or FSDP-sharded
        self.optimizer = self._new_optimizer(self.model)
        if cfg.compile:           # build the training kernels now: a first build inside the trace breaks the graph
            attention_cpu.load()
            activation_cpu.load()
            self.forward = torch.compile(self.forward)
        width = getattr(getattr(model, "config", None), "d_model", 0)
        self.dtype = resolve_dtype(cfg.precision, self.device.split(":")[0], width)
        self.step, self.tokens_seen, self.elapsed = 0, 0, 0.0
        self.best_val = float("inf")
        self.saved_step: int | None = None
        self.history: list[dict] = []
        self.peak: float | None = None          # matmul peak FLOP/s of all ranks, for MFU (set by the caller)
        self.lock: RunLock | None = None        # the run folder's lock, held to the end of fit()

    # ------------------------------------------------------------------ resume
    def resume(self, folder: Path, state: dict, opt_state: dict | None) -> None:
        """Continue from checkpoint ``folder``: weights, optimizer state and RNG, whichever layout (one
        file / shards) saved them and this run uses, and the counters of ``state`` (trainer.json)."""
        dist_checkpoint.load(self.dist, folder, self.model, self.optimizer, opt_state, self._new_optimizer)
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        self.elapsed, self.best_val = state["elapsed_s"], state["best_val_loss"]
        self.saved_step = state["step"]

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict:
        """Train until ``max_steps``, a signal, the time limit or the task's target; a summary dict.

        Raises:
            ConfigError: the loss became NaN/inf (with ``on_nonfinite="raise"``; the message names the
                step; the last checkpoint is kept).
        """
        cfg, task = self.cfg, self.task
        metrics = None
        if self.out_dir is not None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self.lock = self.lock or RunLock(self.out_dir)               # rank 0's (see runlock.py)
            metrics = open(self.out_dir / "metrics.jsonl", "a", encoding="utf-8") if self.dist.is_main else None
        bar = self._progress()
        stop = {"why": None}
        eval_s = 0.0
        restore = _install_signals(stop) if self.out_dir is not None else (lambda: None)   # nothing to save: default
        self.model.train()
        try:
            if task.eval_at_start and self.step == 0 and self.saved_step is None:
                self._evaluate(metrics, bar)
            window_t, window_steps, start = time.perf_counter(), 0, time.perf_counter()
            while self.step < cfg.max_steps:
                # Any rank's stop request stops every rank here, and becomes this rank's own: a rank whose
                # signal has not arrived yet must still save with the others (the save is collective).
                stop["why"] = self.dist.agree(stop["why"] or self._signalled())
                if stop["why"]:
                    raise Stop
                lr = schedule_at(cfg, self.step)
                loss = self._train_step(lr)
                if not math.isfinite(loss):
                    self._nonfinite(loss, stop)
                self.step += 1
                self.tokens_seen += task.tokens_per_step
                window_steps += 1
                if self.step % cfg.log_interval == 0 or self.step == cfg.max_steps:
                    self._log_window(metrics, bar, loss, lr, time.perf_counter() - window_t, window_steps)
                    window_steps = 0
                bar.update(1)
                if cfg.time_limit and self.elapsed + time.perf_counter() - start > cfg.time_limit:
                    stop["why"] = stop["why"] or "time"
                stop["why"] = self.dist.agree(stop["why"] or self._signalled())
                if self.step % cfg.eval_interval == 0 or self.step == cfg.max_steps or stop["why"] == "time":
                    t_eval = time.perf_counter()
                    self.elapsed += t_eval - start
                    if self._evaluate(metrics, bar) and stop["why"] is None:
                        stop["why"] = "done"
                    self.save()
                    start = time.perf_counter()
                    eval_s += start - t_eval
                    window_t, window_steps = start, 0
                elif self.step % cfg.log_interval == 0:
                    window_t = time.perf_counter()
        except Stop:
            pass
        finally:
            restore()
            bar.close()
            if metrics:
                metrics.close()
            if not stop["why"] and self.lock:
                self.lock = self.lock.release()
        if stop["why"] and stop["why"] != "nonfinite":
            self.save()
            self.lock = self.lock.release() if self.lock else None
            self._log_stop(stop["why"])
        elif self.lock:
            self.lock = self.lock.release()
        return {"step": self.step, "stopped": stop["why"], "best_val_loss": self.best_val,
                "history": self.history, "out_dir": str(self.out_dir) if self.out_dir else None,
                "eval_save_s": eval_s, "elapsed_s": self.elapsed}

    def _train_step(self, lr: float) -> float:
        """One optimizer step at learning rate ``lr``; the mean loss of the global batch. A non-finite
        loss leaves the model and optimizer as they were (no update)."""
        cfg = self.cfg
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)      # Muon's groups run at muon_lr / lr of it
        total = torch.zeros((), device=self.device)
        for last, batch, share in self.task.pieces(self.step, self.dist):   # this rank's rows (see distributed.py)
            batch = to_device(batch, self.device)
            with self.dist.gradient_sync(self.forward, last):
                with torch.autocast(self.device.split(":")[0], dtype=torch.bfloat16,
                                    enabled=self.dtype == torch.bfloat16):
                    loss = self.task.loss(self.forward, batch)
                (loss / share).backward()
            total += loss.detach() / share
        mean = self.dist.sum(float(total)) / self.dist.world_size        # every rank sees the same value
        if math.isfinite(mean):
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip, foreach=True)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return mean

    def evaluate(self) -> dict[str, float]:
        """The task's held-out measurements of the current model (eval mode, no gradients)."""
        self.model.eval()
        try:
            with torch.no_grad():
                return self.task.evaluate(self)
        finally:
            self.model.train()

    def save(self) -> Path | None:
        """Write a checkpoint of the current step (atomically; see :mod:`tformer.training.runs`);
        nothing without ``out_dir``."""
        if self.out_dir is None:
            return None
        state = {"step": self.step, "train_config": dataclasses.asdict(self.cfg), "tokens_seen": self.tokens_seen,
                 "elapsed_s": self.elapsed, "best_val_loss": self.best_val, "torch": torch.__version__,
                 **self.task.state()}
        folder = dist_checkpoint.save(self.dist, self.out_dir, self.step, self.checkpoint_model(), self.optimizer,
                                      self.task.tokenizer, state, final=self.step >= self.cfg.max_steps)
        self.saved_step = self.step
        return folder

    # ------------------------------------------------------------------ helpers
    def checkpoint_model(self) -> torch.nn.Module:
        """What a checkpoint's weights are read from: the model (a subclass may save a part of it)."""
        return self.model

    def _new_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        cfg = self.cfg
        return build_optimizer(model, cfg, self.device)

    def _signalled(self) -> str | None:
        """A stop signal held pending for this rank (under torchrun; see distributed.hold_stop_signals)."""
        why = self.dist.pending_stop()
        if why is not None:
            _announce(why)
        return why

    def _nonfinite(self, loss: float, stop: dict) -> None:
        if self.on_nonfinite == "stop":
            stop["why"] = "nonfinite"
            raise Stop
        kept = (f"the last good checkpoint (step {self.saved_step}) is kept in {self.out_dir}"
                if self.saved_step is not None else "no checkpoint had been saved yet")
        raise ConfigError(f"the loss became {loss} at step {self.step + 1}; {kept}. Lower the learning "
                          f"rate (--set lr=...), keep gradient clipping on, or use --set precision=fp32.")

    def _log_window(self, metrics, bar, loss: float, lr: float, dt: float, steps: int) -> None:
        rec = {"step": self.step, "loss": loss, "lr": lr, "ms_per_step": 1e3 * dt / steps}
        shown = f"loss {loss:.4f} lr {lr:.2e}"
        if self.task.tokens_per_step:
            rec["tokens_per_s"] = tok_s = steps * self.task.tokens_per_step / dt
            shown += f" {tok_s:,.0f} tok/s"
            if self.task.flops_per_token and self.peak:
                rec["mfu"] = self.task.flops_per_token * tok_s / self.peak
                shown += f" MFU {100 * rec['mfu']:.1f}%"
        self._record(metrics, rec)
        bar.set_postfix_str(shown)

    def _evaluate(self, metrics, bar) -> bool:
        """Evaluate, record and report; whether the task's target is reached."""
        losses = self.evaluate()
        if not losses:
            return False
        if "val_loss" in losses:
            self.best_val = min(self.best_val, losses["val_loss"])
        self._record(metrics, {"step": self.step, **losses})
        for line in self.task.report(self.step, losses):
            bar.write(line)
        return self.task.should_stop(losses)

    def _record(self, metrics, rec: dict) -> None:
        rec = {"time": round(time.time(), 3), **rec}
        self.history.append(rec)
        if metrics:                                   # rank 0 alone writes metrics.jsonl
            metrics.write(json.dumps(rec) + "\n")
            metrics.flush()

    def _log_stop(self, why: str) -> None:
        what = {"int": "interrupted", "term": "terminated (SIGTERM)", "done": "target reached"}.get(
            why, f"time limit {self.cfg.time_limit:g} s reached")
        if self.out_dir is None:
            self.log(f"{what} at step {self.step}")
        else:
            self.log(f"{what} at step {self.step}; checkpoint saved in {self.out_dir}"
                     + (f"; continue with: {self.resume_hint}" if why != "done" else ""))

    def _progress(self):
        if not self.dist.is_main:
            return _QuietBar()
        if self.make_bar is not None:
            return self.make_bar(self.cfg.max_steps, self.step)
        from tqdm import tqdm
        return tqdm(total=self.cfg.max_steps, initial=self.step, disable=not self.cfg.progress, dynamic_ncols=True,
                    unit="step", file=sys.stderr, leave=True)


def fit(model: torch.nn.Module, task: Task, cfg: TrainConfig, **kw) -> tuple[torch.nn.Module, dict]:
    """Train ``model`` on ``task`` (see :class:`Loop` for the keywords); ``(model in eval mode, summary)``."""
    loop = Loop(model, task, cfg, **kw)
    summary = loop.fit()
    return loop.model.eval(), summary


class _QuietBar:
    """The progress bar of ranks other than 0: it shows and writes nothing."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def _announce(why: str) -> None:
    name = "SIGTERM" if why == "term" else "Ctrl-C"
    if os.environ.get("RANK", "0") == "0":            # under torchrun every rank gets it: rank 0 says so
        print(f"\n{name}: stopping after this step and saving a checkpoint (again to abort) ...", file=sys.stderr)


def _install_signals(stop: dict):
    """First Ctrl-C (or SIGTERM, as ``timeout``, ``docker stop``, Slurm and the ``--nproc`` launcher
    send) asks the loop to stop at the next step boundary and save; a second one aborts."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum, frame):
        if stop["why"] in STOP_SIGNALS.values():
            raise KeyboardInterrupt
        stop["why"] = STOP_SIGNALS[signum]
        _announce(stop["why"])

    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    return lambda: [signal.signal(s, h) for s, h in previous.items()]
