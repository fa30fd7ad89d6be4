"""Language-model runs (``tformer train``): build or resume a run from a corpus and a preset, and
train it with the one training loop (:mod:`tformer.training.loop`) on the language-modelling task
(:mod:`tformer.training.tasks.lm`).

:meth:`Trainer.create` checks everything up front (settings, corpus, checkpoint compatibility,
the run folder's lock) before a step is trained; :meth:`Trainer.fit` logs the model and runs the loop.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tformer.accounting import training_flops_per_token
from tformer.checkpoint import load_config, read_pointer
from tformer.config import TransformerConfig
from tformer.errors import ConfigError, InputError
from tformer.generation.generate import generate
from tformer.machine import auto_threads, cached_matmul_peak_flops
from tformer.mixers import check_config as check_mixers
from tformer.models import build_model
from tformer.tokenizers import load_tokenizer
from tformer.training import distributed
from tformer.training.config import (AUTO_BF16_MIN_WIDTH, MODEL_KEYS, TRAIN_KEYS,  # noqa: F401
                                     TrainConfig, cast_value, check_language_model, check_model_settings)
from tformer.training.data import Corpus, corpus_fingerprint, default_cache_dir, load_corpus, resolve_corpus
from tformer.training.loop import Loop, Stop  # noqa: F401
from tformer.training.recipes import apply_recipe
from tformer.training.runlock import check_run_folder, locked_run
from tformer.training.runstate import check_more_steps, read_latest, start_metrics
from tformer.training.tasks.lm import EVAL_TOKENS_PER_PASS, LanguageModelling  # noqa: F401


class Trainer(Loop):
    """One language-model run. Build it with :meth:`create` (new or resumed), then call :meth:`fit`."""

    def __init__(self, cfg: TrainConfig, model_config: TransformerConfig, corpus: Corpus, out_dir: Path,
                 preset: str, log=print):
        self.corpus, self.preset = corpus, preset
        torch.set_num_threads(cfg.threads or auto_threads(distributed.local_ranks()))
        distributed.setup(cfg.device, cfg.dist_timeout).check_batch(cfg.batch_size, cfg.grad_accum)
        torch.manual_seed(cfg.seed)
        T = model_config.context_length
        task = LanguageModelling(corpus, cfg, T, training_flops_per_token(model_config, T), preset,
                                 sampler=lambda: self.sample(cfg.sample_tokens))
        super().__init__(build_model(model_config), task, cfg, out_dir=out_dir, log=log)
        if self.dist.active:
            self.resume_hint = f"tformer train --nproc {self.dist.world_size} --resume --out {out_dir}"

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
        check_run_folder(out_dir)
        if resume and (not out_dir.exists() or not any(p.name != ".lock" for p in out_dir.iterdir())):
            raise InputError(f"nothing to resume: {out_dir} holds no run; drop --resume to start one, "
                             f"or pass the --out folder of an earlier run.")
        start = cls._resume if resume else cls._new
        return locked_run(out_dir, lambda: start(out_dir, preset, model_kw, train_kw, log))

    @classmethod
    def _new(cls, out_dir: Path, preset, model_kw, train_kw, log) -> "Trainer":
        if (pointer := read_pointer(out_dir, missing_ok=True)) is not None:
            step = pointer["step"]
            raise InputError(f"{out_dir} already holds a checkpoint (step {step}); pass --resume to continue it, "
                             f"or choose another --out to start a new run.")
        model_kw, train_kw = apply_recipe(train_kw.get("recipe", "auto"), preset or "tiny", model_kw, train_kw)
        cfg = TrainConfig(**{**train_kw, "out_dir": str(out_dir)})
        check_language_model(TransformerConfig.from_name(preset or "tiny", **model_kw, vocab_size=256))  # before the corpus
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
        folder, state, opt_state = read_latest(out_dir)
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
        trainer.resume(folder, state, opt_state)
        if trainer.dist.is_main:
            start_metrics(out_dir, trainer.step)  # records logged after the checkpoint are logged again
        log(f"resumed {out_dir} at step {trainer.step} from {folder}")
        return trainer

    # ------------------------------------------------------------------ the run
    def fit(self) -> dict:
        """Train until ``max_steps``, Ctrl-C or the time limit; returns a summary dict.

        Raises:
            ConfigError: the loss became NaN/inf (the message names the step; the last checkpoint is kept).
        """
        cfg, T = self.cfg, self.model.config.context_length
        self.peak = cached_matmul_peak_flops(self.dtype, self.device, cfg.cache_dir or default_cache_dir()) \
            * self.dist.world_size
        self.log(f"model: {self.model.num_parameters():,} parameters ({self.preset}), context {T}, "
                 f"vocab {self.model.config.vocab_size} ({self.corpus.tokenizer.kind}); corpus {len(self.corpus.train):,} "
                 f"train / {len(self.corpus.val):,} val tokens; {str(self.dtype).replace('torch.', '')} on {self.device}, "
                 f"{torch.get_num_threads()} thread(s){self._ranks()}; measured matmul peak {self.peak / 1e9:.0f} GFLOP/s")
        self.check_duration()
        return {**super().fit(), "peak_flops": self.peak}

    def check_duration(self) -> None:
        """Say what one step costs and how long the run will take at the least, before the first step; refuse a
        run that would take longer than ``max_hours`` (a context of 100,000 on the tiny preset: months).

        The time is a lower bound: the step's training FLOPs (:func:`~tformer.accounting.training_flops_per_token`,
        attention included, as ``tformer plan`` counts them) at the measured matmul peak, which no training step
        reaches (the MFU the progress line shows is the fraction it does).

        Raises:
            ConfigError: the run, or its ``time_limit`` if shorter, would take more than ``max_hours`` hours.
        """
        cfg, T = self.cfg, self.model.config.context_length
        if not self.peak > 0:                     # no measurement to estimate from
            return
        step_flops = self.task.flops_per_token * cfg.batch_size * cfg.grad_accum * T * self.dist.world_size
        step_s = step_flops / self.peak
        left = max(cfg.max_steps - self.step, 0)
        run_s = step_s * left
        self.log(f"one step: {step_flops:.3g} FLOPs ({cfg.batch_size * cfg.grad_accum * self.dist.world_size} x {T} "
                 f"tokens); at the measured peak at least {duration(step_s)} a step, {duration(run_s)} for the "
                 f"{left:,} steps to go")
        bounded = min(run_s, cfg.time_limit + step_s) if cfg.time_limit else run_s
        if cfg.max_hours and bounded > cfg.max_hours * 3600:
            raise ConfigError(f"this run would take at least {duration(bounded)} here ({step_flops:.3g} FLOPs a step, "
                              f"{left:,} steps, at the measured matmul peak of {self.peak / 1e9:.0f} GFLOP/s), more than "
                              f"max_hours={cfg.max_hours:g}; shorten it (context_length, batch_size, max_steps, a "
                              f"smaller model), or allow it with --set max_hours=0 (no limit) or a larger value.")

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

    def _ranks(self) -> str:
        d = self.dist
        return f" per rank, {d.world_size} ranks ({self.cfg.strategy}, {d.backend})" if d.active else ""


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


def duration(seconds: float) -> str:
    """``seconds`` in the largest unit that keeps it at least 1 (years, days, hours, minutes, s), 3 digits."""
    for unit, size in (("years", 365 * 86400), ("days", 86400), ("hours", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds:.3g} s"
