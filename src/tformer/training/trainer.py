"""The training loop: batches -> loss -> AdamW step, with evaluation, sampling, metrics and checkpoints.

    for step in range(start, max_steps):
        lr = warmup + cosine(step)
        grad_accum x (batch(seed, step, micro) -> forward under autocast -> backward)
        clip gradients -> AdamW step
        every log_interval: progress bar + metrics.jsonl;  every eval_interval: evaluate, sample, save

Exact resume: the batch of step s is drawn from a generator seeded with (seed, s, micro), the
learning rate is a function of s, and a checkpoint stores the weights, the optimizer state and the
torch RNG; so k steps + resume + k steps repeat 2k steps bit for bit (fp32).
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
from typing import Any

import torch
import torch.nn.functional as F

from tformer.accounting import training_flops_per_token
from tformer.checkpoint import load_config, read_pointer, resolve_checkpoint
from tformer.training.runs import load_training_state
from tformer.config import TransformerConfig
from tformer.mixers import check_config as check_mixers
from tformer.errors import ConfigError, InputError
from tformer.generation.generate import generate
from tformer.models import build_model
from tformer.training import dist_checkpoint, distributed
from tformer.training.config import (AUTO_BF16_MIN_WIDTH, MODEL_KEYS, PRECISIONS, TRAIN_KEYS,  # noqa: F401
                                     TrainConfig, cast_value, check_model_settings)
from tformer.training.data import (Corpus, corpus_fingerprint, default_cache_dir, get_batch, load_corpus,
                                   resolve_corpus)
from tformer.training.optim import lr_at, make_optimizer
from tformer.machine import bf16_supported, busy_cores, cached_matmul_peak_flops
from tformer.training.runlock import RunLock
from tformer.training.runstate import check_more_steps, check_state, start_metrics
from tformer.tokenizers import load_tokenizer

_DEFAULT_THREADS = torch.get_num_threads()
# Evaluation stacks its fixed batches into forwards of up to this many tokens: one pass of 15,360
# tokens costs less than 20 passes of 768 at nanoGPT's CPU configuration (see docs/training.md).
EVAL_TOKENS_PER_PASS = 16384


class Stop(Exception):
    """Raised inside the loop to end the run early (Ctrl-C or the time limit)."""


class Trainer:
    """One training run. Build it with :meth:`create` (new or resumed), then call :meth:`fit`."""

    def __init__(self, cfg: TrainConfig, model_config: TransformerConfig, corpus: Corpus, out_dir: Path,
                 preset: str, log=print):
        self.cfg, self.corpus, self.out_dir, self.preset, self.log = cfg, corpus, out_dir, preset, log
        torch.set_num_threads(cfg.threads or auto_threads())
        self.dist = distributed.setup(cfg.device, cfg.dist_timeout)     # one process, or a rank under torchrun
        self.dist.check_batch(cfg.batch_size, cfg.grad_accum)
        device = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
        self.device = self.dist.place(device)
        torch.manual_seed(cfg.seed)
        self.model = build_model(model_config).to(self.device)
        self.forward = self.dist.wrap(self.model, cfg.strategy, self.device)   # the model, DDP, or FSDP-sharded
        self.optimizer = self._new_optimizer(self.model)
        self.forward = torch.compile(self.forward) if cfg.compile else self.forward
        use_bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and bf16_supported(self.device)
                                                and (self.device != "cpu" or model_config.d_model >= AUTO_BF16_MIN_WIDTH))
        self.dtype = torch.bfloat16 if use_bf16 else torch.float32
        self.step, self.tokens_seen, self.elapsed = 0, 0, 0.0
        self.best_val = float("inf")
        self.saved_step: int | None = None
        self.history: list[dict] = []
        self.lock: RunLock | None = None  # the run folder's lock, held from create() to the end of fit()

    # ------------------------------------------------------------------ building a run
    @classmethod
    def create(cls, overrides: dict[str, Any] | None = None, *, preset: str | None = None, resume: bool = False,
               log=print) -> "Trainer":
        """A new run, or one resumed from ``out_dir``'s latest checkpoint.

        Args:
            overrides: TrainConfig and TransformerConfig fields (already typed, see :func:`cast_value`).
            preset: model preset for a new run (default ``tiny``); on resume it must match the checkpoint's.
            resume: continue the run in ``out_dir``.
        Raises:
            ConfigError: unknown keys or bad values, settings that differ from the checkpoint's on resume.
            InputError: a missing, empty or too short corpus, a different corpus on resume, a resumed run
                already at ``max_steps``, an ``out_dir`` that is a file, holds a checkpoint already (new
                run) or none (resume), or is in use.
            CheckpointError: an unreadable or incomplete checkpoint on resume.
        """
        overrides = {k: cast_value(k, v) for k, v in (overrides or {}).items()}
        model_kw = {k: v for k, v in overrides.items() if k in MODEL_KEYS}
        train_kw = {k: v for k, v in overrides.items() if k in TRAIN_KEYS}
        check_model_settings(model_kw)
        out_dir = Path(train_kw.get("out_dir") or f"runs/{preset or 'tiny'}")
        dist = distributed.setup(train_kw.get("device", "auto"), train_kw.get("dist_timeout", 600.0))
        log = log if dist.is_main else _quiet     # rank 0 alone logs
        if out_dir.exists() and not out_dir.is_dir():
            raise InputError(f"--out {out_dir} is a file, not a folder; pass a folder for the run.")
        if resume and (not out_dir.exists() or not any(p.name != ".lock" for p in out_dir.iterdir())):
            raise InputError(f"nothing to resume: {out_dir} holds no run; drop --resume to start one, "
                             f"or pass the --out folder of an earlier run.")
        lock = RunLock(out_dir)
        try:
            trainer = (cls._resume if resume else cls._new)(out_dir, preset, model_kw, train_kw, log)
        except BaseException:
            lock.release()
            raise
        trainer.lock = lock
        return trainer

    @classmethod
    def _new(cls, out_dir: Path, preset, model_kw, train_kw, log) -> "Trainer":
        if (pointer := read_pointer(out_dir, missing_ok=True)) is not None:
            step = pointer["step"]
            raise InputError(f"{out_dir} already holds a checkpoint (step {step}); pass --resume to continue it, "
                             f"or choose another --out to start a new run.")
        cfg = TrainConfig(**{**train_kw, "out_dir": str(out_dir)})
        with distributed.setup().main_first():      # rank 0 tokenises into the cache, the others then read it
            corpus = load_corpus(cfg.data, tokenizer=cfg.tokenizer, bpe_vocab_size=cfg.bpe_vocab_size,
                                 val_fraction=cfg.val_fraction, cache_dir=cfg.cache_dir, encoding=cfg.encoding,
                                 log=log)
        model_config = TransformerConfig.from_name(preset or "tiny", **model_kw,
                                                   vocab_size=corpus.tokenizer.vocab_size)
        check_mixers(model_config)                  # a mixer's refusals before the corpus length
        _check_length(corpus, model_config.context_length)
        if distributed.setup().is_main:
            start_metrics(out_dir, None)  # a run that died before its first checkpoint leaves a log: start it over
        return cls(cfg, model_config, corpus, out_dir, preset or "tiny", log)

    @classmethod
    def _resume(cls, out_dir: Path, preset, model_kw, train_kw, log) -> "Trainer":
        folder = resolve_checkpoint(out_dir)
        state, opt_state = load_training_state(folder)
        check_state(state, opt_state, folder)
        saved, _ = load_config(folder)
        asked = {"preset": preset} if preset and preset != saved.name else {}
        asked.update({k: v for k, v in model_kw.items() if getattr(saved, k) != v})
        for key in ("tokenizer", "bpe_vocab_size", "val_fraction", "seed"):
            if key in train_kw and train_kw[key] != state["train_config"][key]:
                asked[key] = train_kw[key]
        if asked:
            have = {k: (saved.name if k == "preset" else getattr(saved, k, state["train_config"].get(k))) for k in asked}
            raise ConfigError(f"the checkpoint in {folder} is incompatible with this run: it has "
                             f"{_kv(have)} but this run asks for {_kv(asked)}; resume with the original settings "
                             f"(drop these --preset/--set values) or start a new run with another --out.")
        saved_cfg = {k: v for k, v in state["train_config"].items() if k in TRAIN_KEYS}
        cfg = TrainConfig(**{**saved_cfg, **train_kw, "out_dir": str(out_dir)})
        files = resolve_corpus(cfg.data, cfg.encoding)
        if corpus_fingerprint(files) != state["corpus_fingerprint"]:
            raise InputError(f"the corpus {cfg.data or '(built-in)'} differs from the one the checkpoint in {folder} "
                             f"was trained on; resume with the original --data ({state['train_config']['data'] or 'none: the built-in corpus'}) "
                             f"or start a new run with another --out.")
        check_more_steps(out_dir, state["step"], cfg.max_steps)
        with distributed.setup().main_first():
            corpus = load_corpus(cfg.data, tokenizer=load_tokenizer(folder), val_fraction=cfg.val_fraction,
                                 cache_dir=cfg.cache_dir, encoding=cfg.encoding, log=log)
        trainer = cls(cfg, saved, corpus, out_dir, saved.name, log)
        # weights, optimizer state and RNG, whichever layout (one file / shards) saved them and this run uses
        dist_checkpoint.load(trainer.dist, folder, trainer.model, trainer.optimizer, opt_state, trainer._new_optimizer)
        trainer.step, trainer.tokens_seen = state["step"], state["tokens_seen"]
        trainer.elapsed, trainer.best_val = state["elapsed_s"], state["best_val_loss"]
        trainer.saved_step = state["step"]
        if trainer.dist.is_main:
            start_metrics(out_dir, trainer.step)  # records logged after the checkpoint are logged again
        log(f"resumed {out_dir} at step {trainer.step} from {folder}")
        return trainer

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict:
        """Train until ``max_steps``, Ctrl-C or the time limit; returns a summary dict.

        Raises:
            ConfigError: the loss became NaN/inf (the message names the step; the last checkpoint is kept).
        """
        cfg, T = self.cfg, self.model.config.context_length
        decay = cfg.decay_steps or cfg.max_steps
        tokens_per_step = cfg.batch_size * cfg.grad_accum * T            # the global batch, over all ranks
        flops_per_token = training_flops_per_token(self.model.config, T)
        peak = cached_matmul_peak_flops(self.dtype, self.device, cfg.cache_dir or default_cache_dir()) * self.dist.world_size
        self.log(f"model: {self.model.num_parameters():,} parameters ({self.preset}), context {T}, "
                 f"vocab {self.model.config.vocab_size} ({self.corpus.tokenizer.kind}); corpus {len(self.corpus.train):,} "
                 f"train / {len(self.corpus.val):,} val tokens; {str(self.dtype).replace('torch.', '')} on {self.device}, "
                 f"{torch.get_num_threads()} thread(s){self._ranks()}; measured matmul peak {peak / 1e9:.0f} GFLOP/s")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.lock = self.lock or RunLock(self.out_dir)               # rank 0's (see runlock.py)
        metrics = open(self.out_dir / "metrics.jsonl", "a", encoding="utf-8") if self.dist.is_main else None
        bar = _progress(cfg.max_steps, self.step, cfg.progress, quiet=not self.dist.is_main)
        stop = {"why": None}
        eval_s = 0.0
        restore = _install_sigint(stop)
        try:
            if self.step == 0 and self.saved_step is None:
                self._evaluate(metrics, bar)
            window_t, window_steps, start, eval_s = time.perf_counter(), 0, time.perf_counter(), 0.0
            while self.step < cfg.max_steps:
                if self.dist.agree(stop["why"]):   # any rank's stop request stops every rank here
                    raise Stop
                lr = lr_at(self.step, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=cfg.warmup_steps, decay_steps=decay)
                loss = self._train_step(lr)
                self.step += 1
                self.tokens_seen += tokens_per_step
                window_steps += 1
                if not math.isfinite(loss):
                    kept = (f"the last good checkpoint (step {self.saved_step}) is kept in {self.out_dir}"
                            if self.saved_step is not None else "no checkpoint had been saved yet")
                    raise ConfigError(f"the loss became {loss} at step {self.step}; {kept}. Lower the learning "
                                     f"rate (--set lr=...), keep gradient clipping on, or use --set precision=fp32.")
                if self.step % cfg.log_interval == 0 or self.step == cfg.max_steps:
                    dt = time.perf_counter() - window_t
                    tok_s = window_steps * tokens_per_step / dt
                    rec = {"step": self.step, "loss": loss, "lr": lr, "ms_per_step": 1e3 * dt / window_steps,
                           "tokens_per_s": tok_s, "mfu": flops_per_token * tok_s / peak}
                    self._record(metrics, rec)
                    bar.set_postfix_str(f"loss {loss:.4f} lr {lr:.2e} {tok_s:,.0f} tok/s MFU {100 * rec['mfu']:.1f}%")
                    window_steps = 0
                bar.update(1)
                if cfg.time_limit and self.elapsed + time.perf_counter() - start > cfg.time_limit:
                    stop["why"] = stop["why"] or "time"
                stop["why"] = self.dist.agree(stop["why"])
                if self.step % cfg.eval_interval == 0 or self.step == cfg.max_steps or stop["why"] == "time":
                    t_eval = time.perf_counter()
                    self.elapsed += t_eval - start
                    self._evaluate(metrics, bar)
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
            if not stop["why"]:
                self.lock = self.lock.release()
        if stop["why"]:
            self.save()
            self.lock = self.lock.release()
            why = {"int": "interrupted", "term": "terminated (SIGTERM)"}.get(stop["why"], f"time limit {cfg.time_limit:g} s reached")
            self.log(f"{why} at step {self.step}; checkpoint saved in {self.out_dir}; "
                     f"continue with: tformer train --resume --out {self.out_dir}")
        return {"step": self.step, "stopped": stop["why"], "best_val_loss": self.best_val,
                "history": self.history, "peak_flops": peak, "out_dir": str(self.out_dir),
                "eval_save_s": eval_s}

    def _train_step(self, lr: float) -> float:
        cfg = self.cfg
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        total = torch.zeros((), device=self.device)
        # this rank's rows of the step's global batch (all of them in one process); see distributed.py
        for last, x, y, share in self.dist.batches(self.corpus.train, cfg.batch_size, cfg.grad_accum,
                                                   self.model.config.context_length, (cfg.seed, 0, self.step)):
            x, y = x.to(self.device), y.to(self.device)
            with self.dist.gradient_sync(self.forward, last):
                with torch.autocast(self.device.split(":")[0], dtype=torch.bfloat16,
                                    enabled=self.dtype == torch.bfloat16):
                    _, loss = self.forward(x, y)
                (loss / share).backward()
            total += loss.detach() / share
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return self.dist.sum(float(total)) / self.dist.world_size    # the mean loss of the global batch

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Mean loss over ``eval_batches`` fixed batches of each split (the same batches every time)."""
        cfg, T = self.cfg, self.model.config.context_length
        self.model.eval()
        out = {}
        share = list(self.dist.eval_share(cfg.eval_batches))              # (k, weight); every k in one process
        per_pass = max(1, EVAL_TOKENS_PER_PASS // (cfg.batch_size * T))      # batches stacked into one forward
        for i, (name, data) in enumerate((("train", self.corpus.train), ("val", self.corpus.val))):
            total = 0.0
            for c in range(0, len(share), per_pass):
                chunk = share[c:c + per_pass]
                xs, ys = zip(*(get_batch(data, cfg.batch_size, T, (cfg.seed, 1 + i, k)) for k, _ in chunk))
                with torch.autocast(self.device.split(":")[0], dtype=torch.bfloat16,
                                    enabled=self.dtype == torch.bfloat16):
                    logits, _ = self.forward(torch.cat(xs).to(self.device))   # (len(chunk)·batch, T, vocab)
                losses = F.cross_entropy(logits.flatten(0, 1).float(), torch.cat(ys).to(self.device).flatten(),
                                         reduction="none")                     # (len(chunk)·batch·T,)
                batch_means = losses.view(len(chunk), -1).mean(1)       # equal-sized batches: one mean each
                total += float(sum(w * m for (_, w), m in zip(chunk, batch_means.tolist())))
            out[f"{name}_loss"] = self.dist.sum(total) / cfg.eval_batches
        self.model.train()
        return out

    def sample(self, max_new_tokens: int, prompt: str | None = None, temperature: float = 0.8,
               top_k: int | None = 40, seed: int | None = None) -> str:
        """Text generated from ``prompt`` (default ``sample_prompt``) by the current model, on rank 0
        ("" on the others; with FSDP every rank must call this: it gathers the weights)."""
        model = self.dist.full_model(self.model) if self.dist.sharded else self.model
        if not self.dist.is_main:
            return ""
        model = model.to(self.device)
        tok = self.corpus.tokenizer
        prompt = self.cfg.sample_prompt if prompt is None else prompt
        try:
            ids = tok.encode(prompt) if prompt else []
        except ValueError:
            ids = []
        if not ids:
            ids = [int(self.corpus.val[0])]
        ids = ids[-self.model.config.context_length:]  # a long prompt keeps its end, as nanoGPT crops
        out = generate(model, torch.tensor([ids], device=self.device), max_new_tokens,
                       temperature=temperature, top_k=top_k, seed=self.cfg.seed if seed is None else seed)
        return tok.decode(out[0].tolist())

    def save(self) -> Path:
        """Write a checkpoint of the current step (atomically; see :mod:`tformer.checkpoint`)."""
        state = {"step": self.step, "train_config": dataclasses.asdict(self.cfg), "preset": self.preset,
                 "corpus_fingerprint": self.corpus.fingerprint, "tokens_seen": self.tokens_seen,
                 "elapsed_s": self.elapsed, "best_val_loss": self.best_val, "torch": torch.__version__}
        folder = dist_checkpoint.save(self.dist, self.out_dir, self.step, self.model, self.optimizer,
                                      self.corpus.tokenizer, state, final=self.step >= self.cfg.max_steps)
        self.saved_step = self.step
        return folder

    # ------------------------------------------------------------------ helpers
    def _new_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        cfg = self.cfg
        return make_optimizer(model, cfg.lr, (cfg.beta1, cfg.beta2), cfg.weight_decay, self.device)

    def _ranks(self) -> str:
        d = self.dist
        return f" per rank, {d.world_size} ranks ({self.cfg.strategy}, {d.backend})" if d.active else ""

    def _evaluate(self, metrics, bar) -> None:
        losses = self.evaluate()
        self.best_val = min(self.best_val, losses["val_loss"])
        self._record(metrics, {"step": self.step, **losses})
        bar.write(f"step {self.step}: train loss {losses['train_loss']:.4f}, val loss {losses['val_loss']:.4f}")
        if self.cfg.sample_tokens:
            text = self.sample(self.cfg.sample_tokens)
            bar.write("  | " + "\n  | ".join(text.splitlines()[:8]))

    def _record(self, metrics, rec: dict) -> None:
        rec = {"time": round(time.time(), 3), **rec}
        self.history.append(rec)
        if metrics:                                   # rank 0 alone writes metrics.jsonl
            metrics.write(json.dumps(rec) + "\n")
            metrics.flush()


def auto_threads() -> int:
    """PyTorch's thread count, less the cores other processes keep busy right now; under torchrun,
    the machine's cores divided by its ranks (each rank gets cores // N, so N ranks do not oversubscribe).

    Intra-op threads that share a busy core wait on each other: on a 2-core machine with a load of
    4, two threads ran a tiny-model step 4x slower than one thread did.
    """
    ranks = distributed.local_ranks()       # torchrun's ranks on this machine share its cores
    cores = os.cpu_count() or _DEFAULT_THREADS
    default = _DEFAULT_THREADS if ranks == 1 else cores // ranks
    busy = round(busy_cores(0.5))
    return max(1, min(default, (cores - busy) // ranks))


def _check_length(corpus: Corpus, context: int) -> None:
    need = context + 1
    have = min(len(corpus.val), len(corpus.train))
    if have < need:
        fix = (f"use a longer corpus or a smaller context (--set context_length=N with N <= {have - 1})"
               if have >= 3 else "use a longer corpus (at least a few hundred characters)")
        raise InputError(
            f"the corpus is too short: {corpus.n_tokens} tokens give a validation split of {len(corpus.val)} "
            f"tokens, fewer than one context window ({need} tokens); {fix}.")


def _quiet(message: str) -> None:
    """The log of ranks other than 0."""


def _kv(d: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in d.items())


class _QuietBar:
    """The progress bar of ranks other than 0: it shows and writes nothing."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def _progress(total: int, initial: int, enabled: bool, quiet: bool = False):
    if quiet:
        return _QuietBar()
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, disable=not enabled, dynamic_ncols=True, unit="step",
                file=sys.stderr, leave=True)


def _install_sigint(stop: dict):
    """First Ctrl-C (or SIGTERM, as ``timeout``, ``docker stop`` and Slurm send) asks the loop to stop
    at the next step boundary and save; a second one aborts."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum, frame):
        if stop["why"] in ("int", "term"):
            raise KeyboardInterrupt
        stop["why"] = "term" if signum == signal.SIGTERM else "int"
        name = "SIGTERM" if signum == signal.SIGTERM else "Ctrl-C"
        print(f"\n{name}: stopping after this step and saving a checkpoint (again to abort) ...", file=sys.stderr)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    return lambda: [signal.signal(s, h) for s, h in previous.items()]
