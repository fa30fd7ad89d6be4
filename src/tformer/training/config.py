"""Run settings that are not the architecture (:class:`TrainConfig`), and typing ``--set`` values."""

from __future__ import annotations

import codecs
import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

import torch

from tformer.config import TransformerConfig
from tformer.errors import ConfigError
from tformer.machine import available_cores
from tformer.tokenizers import KINDS
from tformer.training.recipes import RECIPE_NAMES

AUTOCAST_MODES = ("auto", "bf16", "fp32")    # TrainConfig.precision; not inference's weight formats (quant.quantize)
OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("cosine", "wsd")
STRATEGIES = ("ddp", "fsdp")                 # how a run under torchrun spreads over its ranks
# On CPU, bf16 autocast pays for its casts only when the matmuls are wide enough. Measured on a 2-core
# Xeon with AMX (benchmarks/training/train_shakespeare_char.py, docs/training-speed-log.md): once the fused attention
# kernel runs in fp32 under autocast (its bf16 backward is slow), d_model=128 steps in bf16 took about
# 0.65x the fp32 time and d_model=384 less still. So ``auto`` picks bf16 on CPU from this width up.
AUTO_BF16_MIN_WIDTH = 128


@dataclass
class TrainConfig:
    """Everything about a run that is not the architecture. Set any field with ``--set key=value``.

    Args:
        data: corpus file, folder or glob; ``None`` = the built-in stdlib corpus.
        out_dir: run folder (checkpoints, metrics.jsonl); ``None`` = ``runs/<preset>``.
        tokenizer: ``char`` or ``bpe`` (byte-level BPE with ``bpe_vocab_size`` tokens).
        val_fraction: contiguous tail of the corpus kept for validation.
        cache_dir: tokenised-corpus cache; ``None`` = ``~/.cache/tformer``.
        batch_size, grad_accum: sequences per micro-batch, micro-batches per step.
        max_steps: optimizer steps of the run. decay_steps: end of the cosine (0 = max_steps).
        lr, min_lr, warmup_steps: peak and final learning rate, linear-warmup length.
        weight_decay, beta1, beta2, grad_clip: AdamW and clipping (0 = no clipping).
        optimizer: ``adamw``, or ``muon`` (``torch.optim.Muon`` on the hidden matrices at peak rate
            ``muon_lr`` with momentum ``muon_momentum``, AdamW at ``lr`` on embeddings, head, gains, biases).
        schedule: ``cosine`` (warm-up, cosine to ``min_lr``) or ``wsd`` (warm-up, stable, linear decay to
            ``min_lr`` over the last ``cooldown_fraction`` of the steps); see :mod:`tformer.training.schedule`.
        recipe: ``auto``, ``classic`` or ``fast``: the defaults a new run takes for what is not set
            (see :mod:`tformer.training.recipes`); a run saves the one it resolved to.
        target_loss: stop at the first evaluation whose val loss is at most this; 0 = never.
        precision: ``auto`` (bf16 autocast where the hardware has bf16 — on CPU, AVX-512-BF16/AMX — and,
            on CPU, d_model >= 128, where it measured faster; else fp32), ``bf16``, ``fp32``.
        compile: wrap the model in ``torch.compile``.
        checkpointing: activation checkpointing per block (keep each block's input, recompute the rest in
            the backward: less memory, one more forward; see :mod:`tformer.training.checkpointing`).
        trim_heap: with ``checkpointing``, hand the C heap's free pages back to the OS before each block runs
            (glibc ``malloc_trim``): a lower peak RSS for some time (figures: docs/finetune.md).
        threads: torch threads (0 = :func:`tformer.machine.auto_threads`).
        device: ``auto`` (CUDA if present, else CPU), ``cpu`` or ``cuda``.
        seed: model init, batch order and sampling.
        eval_interval, eval_batches: evaluate (and save, and sample) every so many steps on so many batches.
        log_interval: progress/metrics every so many steps.
        sample_tokens, sample_prompt: what is generated at each evaluation (0 = nothing).
        time_limit: stop (saving a checkpoint) after this many seconds; 0 = no limit.
        max_hours: refuse, before the first step, a run whose time here (at least: its FLOPs at the measured
            matmul peak; ``time_limit`` if shorter) exceeds this many hours; 0 = no limit.
        progress: show a progress bar.
        encoding: text encoding of the corpus files (bytes it cannot decode become U+FFFD, counted).
        strategy: under torchrun, ``ddp`` (every rank holds the whole model, gradients all-reduced) or
            ``fsdp`` (FSDP2: parameters, gradients and optimizer state sharded over the ranks).
        dist_timeout: seconds a rank waits in a collective for the others before it fails (not a hang).
    """

    data: str | None = None
    out_dir: str | None = None
    tokenizer: str = "char"
    bpe_vocab_size: int = 1024
    val_fraction: float = 0.1
    cache_dir: str | None = None
    batch_size: int = 12
    grad_accum: int = 1
    max_steps: int = 2000
    decay_steps: int = 0
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0
    optimizer: str = "adamw"
    muon_lr: float = 0.02
    muon_momentum: float = 0.95
    schedule: str = "cosine"
    cooldown_fraction: float = 0.5
    target_loss: float = 0.0
    recipe: str = "auto"
    precision: str = "auto"
    compile: bool = False
    checkpointing: bool = False
    trim_heap: bool = False
    threads: int = 0
    device: str = "auto"
    seed: int = 1337
    eval_interval: int = 250
    eval_batches: int = 20
    log_interval: int = 10
    sample_tokens: int = 200
    sample_prompt: str = "\n"
    time_limit: float = 0.0
    max_hours: float = 24.0
    progress: bool = True
    encoding: str = "utf-8"
    strategy: str = "ddp"
    dist_timeout: float = 600.0

    def __post_init__(self) -> None:
        check_train_settings(self)


# Range of every numeric TrainConfig field: (low, high, low inclusive, high inclusive); None = unbounded.
TRAIN_RANGES = {
    "batch_size": (1, None, True, True), "grad_accum": (1, None, True, True), "max_steps": (1, None, True, True),
    "eval_interval": (1, None, True, True), "eval_batches": (1, None, True, True), "log_interval": (1, None, True, True),
    "decay_steps": (0, None, True, True), "warmup_steps": (0, None, True, True), "sample_tokens": (0, None, True, True),
    "bpe_vocab_size": (256, None, True, True), "val_fraction": (0.0, 1.0, False, False),
    "lr": (0.0, None, False, True), "min_lr": (0.0, None, True, True), "weight_decay": (0.0, None, True, True),
    "beta1": (0.0, 1.0, True, False), "beta2": (0.0, 1.0, True, False), "grad_clip": (0.0, None, True, True),
    "time_limit": (0.0, None, True, True), "seed": (0, 2**63 - 1, True, True), "threads": (0, None, True, True),
    "dist_timeout": (0.0, None, False, True), "muon_lr": (0.0, None, False, True),
    "muon_momentum": (0.0, 1.0, True, False), "cooldown_fraction": (0.0, 1.0, False, True),
    "target_loss": (0.0, None, True, True), "max_hours": (0.0, None, True, True),
}


def check_range(name: str, value, low, high, low_in: bool = True, high_in: bool = True) -> None:
    """Refuse ``value`` unless it is a finite number in the range, naming the setting and the range."""
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
          and (low is None or (value >= low if low_in else value > low))
          and (high is None or (value <= high if high_in else value < high)))
    if not ok:
        lo = "" if low is None else f"{low} {'<=' if low_in else '<'} "
        hi = "" if high is None else f" {'<=' if high_in else '<'} {high}"
        raise ConfigError(f"{name}={value!r} is out of range; it must be a finite number with {lo}{name}{hi}.")


def check_train_settings(cfg: "TrainConfig") -> None:
    """Every TrainConfig field's type, range and finiteness, up front, each message naming the setting.

    A subclass (a task's settings, e.g. ``Seq2SeqSettings``) is checked the same way: its own fields'
    types, and the ranges of its class attribute ``RANGES`` besides :data:`TRAIN_RANGES`.
    """
    for f in dataclasses.fields(cfg):
        value, kind = getattr(cfg, f.name), str(f.type)
        want = bool if kind.startswith("bool") else int if kind.startswith("int") else \
            float if kind.startswith("float") else dict if kind.startswith("dict") else str
        if value is None and "None" in kind:
            continue
        if not (isinstance(value, want) or (want is float and isinstance(value, int))) or \
                (want is int and isinstance(value, bool)):
            raise ConfigError(f"{f.name}={value!r} is not of type {want.__name__}; set it as e.g. --set {f.name}=...")
    for name, bounds in {**TRAIN_RANGES, **getattr(cfg, "RANGES", {})}.items():
        check_range(name, getattr(cfg, name), *bounds)
    if cfg.min_lr > cfg.lr:
        raise ConfigError(f"min_lr={cfg.min_lr} is above lr={cfg.lr}; set min_lr <= lr.")
    if cfg.threads > available_cores():
        raise ConfigError(f"threads={cfg.threads} is more than the {available_cores()} core(s) available; "
                          f"set threads between 1 and {available_cores()} (0 = automatic).")
    if cfg.tokenizer not in KINDS:
        raise ConfigError(f"tokenizer={cfg.tokenizer!r} is not known; choose one of {', '.join(KINDS)}.")
    if cfg.precision not in AUTOCAST_MODES:
        raise ConfigError(f"precision={cfg.precision!r} is not known; choose one of {', '.join(AUTOCAST_MODES)}.")
    if cfg.recipe not in RECIPE_NAMES:
        raise ConfigError(f"recipe={cfg.recipe!r} is not known; choose one of {', '.join(RECIPE_NAMES)}.")
    if cfg.optimizer not in OPTIMIZERS:
        raise ConfigError(f"optimizer={cfg.optimizer!r} is not known; choose one of {', '.join(OPTIMIZERS)}.")
    if cfg.schedule not in SCHEDULES:
        raise ConfigError(f"schedule={cfg.schedule!r} is not known; choose one of {', '.join(SCHEDULES)}.")
    if cfg.optimizer == "muon" and cfg.strategy == "fsdp":
        raise ConfigError("optimizer='muon' does not run on FSDP shards (Newton–Schulz needs whole matrices); "
                          "use strategy=ddp or optimizer=adamw.")
    if cfg.trim_heap and not cfg.checkpointing:
        raise ConfigError("trim_heap=true acts on checkpointed blocks only; add --set checkpointing=true "
                          "(or drop trim_heap).")
    if cfg.strategy not in STRATEGIES:
        raise ConfigError(f"strategy={cfg.strategy!r} is not known; choose one of {', '.join(STRATEGIES)}.")
    if cfg.device not in ("auto", "cpu", "cuda") and not cfg.device.startswith("cuda:"):
        raise ConfigError(f"device={cfg.device!r} is not known; choose auto, cpu or cuda.")
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device={cfg.device!r} but this PyTorch sees no CUDA GPU; use device=cpu (or auto).")
    try:
        codecs.lookup(cfg.encoding)
    except LookupError:
        raise ConfigError(f"encoding={cfg.encoding!r} is not a text encoding Python knows; use e.g. utf-8 or "
                          f"latin-1.") from None


# Model settings the trainer accepts, with their ranges (TransformerConfig checks the rest).
MODEL_RANGES = {
    "norm_eps": (0.0, 1.0, False, True), "rope_base": (1.0, None, False, True), "init_std": (0.0, None, False, True),
    "dropout": (0.0, 1.0, True, False), "attn_dropout": (0.0, 1.0, True, False), "d_ff": (1, None, True, True),
}


def check_model_settings(settings: dict[str, Any]) -> None:
    """The ranges and finiteness of the model settings given with --set, naming the setting."""
    for name, value in settings.items():
        if name in MODEL_RANGES and value is not None:
            check_range(name, value, *MODEL_RANGES[name])
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{name}={value!r} must be a finite number.")


def check_language_model(config: TransformerConfig) -> None:
    """Refuse a model ``tformer train`` cannot train: it trains next-token (causal) language models only."""
    if config.model == "decoder":
        return
    why = (f"model={config.model!r} is a sequence-to-sequence model; train it with --task seq2seq"
           if config.model != "encoder" else
           "causal=false makes a bidirectional encoder, which cannot be trained to predict the next token; "
           "drop causal=false (and model=encoder) to train a language model")
    raise ConfigError(f"tformer train trains causal language models only: {why}.")


TRAIN_KEYS = tuple(f.name for f in dataclasses.fields(TrainConfig))
MODEL_KEYS = tuple(f.name for f in dataclasses.fields(TransformerConfig) if f.name not in ("name", "vocab_size"))


def cast_value(key: str, value: Any, schema: type | None = None) -> Any:
    """Convert ``value`` (a ``--set`` string or a TOML value) to the type of field ``key``.

    Args:
        schema: the dataclass whose fields are the settings (default: TrainConfig and the model's
            TransformerConfig fields, as ``tformer train`` takes them).
    Raises:
        ConfigError: an unknown key (listing the valid ones) or a value of the wrong type.
    """
    if schema is not None:
        fields = {f.name: f for f in dataclasses.fields(schema)}
    else:
        fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
        fields.update({f.name: f for f in dataclasses.fields(TransformerConfig) if f.name in MODEL_KEYS})
    if key not in fields:
        hint = " (it comes from the tokenizer; set bpe_vocab_size for BPE)" if key == "vocab_size" else ""
        raise ConfigError(f"unknown setting {key!r}{hint}; valid keys are: {', '.join(sorted(fields))}.")
    kind = str(fields[key].type)
    optional = "None" in kind
    if isinstance(value, str) and optional and value.lower() in ("none", "null", ""):
        return None
    try:
        if kind.startswith("bool"):
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("1", "true", "yes", "on"):
                return True
            if str(value).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if kind.startswith("int"):
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if kind.startswith("float"):
            return float(value)
        if kind.startswith("dict"):   # mixer_options: JSON, e.g. --set 'mixer_options={"mamba": {"d_state": 8}}'
            value = json.loads(value) if isinstance(value, str) else value
            if not isinstance(value, dict):
                raise ValueError
            return value
        if kind.startswith("list[bool]"):   # window_layers: JSON, e.g. --set 'window_layers=[true, false]'
            value = json.loads(value) if isinstance(value, str) else value
            if not isinstance(value, list):
                raise ValueError
            return value
        if key == "mixer" and isinstance(value, str) and "," in value:   # a layer pattern: mamba,mamba,attention
            return [v.strip() for v in value.split(",")]
        return value if value is None or isinstance(value, list) else str(value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{key}={value!r} is not a valid {kind.split(' ')[0]}; e.g. --set {key}=...") from None
