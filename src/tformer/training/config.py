"""Run settings that are not the architecture (:class:`TrainConfig`), and typing ``--set`` values."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import torch

from tformer.config import TransformerConfig
from tformer.training.tokenizer import KINDS

PRECISIONS = ("auto", "bf16", "fp32")
# On CPU, bf16 autocast pays for its casts only when the matmuls are wide: measured on a 2-core
# Xeon with AMX (benchmarks/train_shakespeare_char.py), d_model=384 trained about 3x faster in bf16
# but d_model=128 is slower (PyTorch's bf16 CPU attention backward dominates). So ``auto``
# picks bf16 on CPU from this width up.
AUTO_BF16_MIN_WIDTH = 256


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
        precision: ``auto`` (bf16 autocast where the hardware has bf16 — on CPU, AVX-512-BF16/AMX — and,
            on CPU, d_model >= 256, where it measured faster; else fp32), ``bf16``, ``fp32``.
        compile: wrap the model in ``torch.compile``. threads: torch threads (0 = :func:`auto_threads`).
        device: ``auto`` (CUDA if present, else CPU), ``cpu`` or ``cuda``.
        seed: model init, batch order and sampling.
        eval_interval, eval_batches: evaluate (and save, and sample) every so many steps on so many batches.
        log_interval: progress/metrics every so many steps.
        sample_tokens, sample_prompt: what is generated at each evaluation (0 = nothing).
        time_limit: stop (saving a checkpoint) after this many seconds; 0 = no limit.
        progress: show a progress bar.
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
    precision: str = "auto"
    compile: bool = False
    threads: int = 0
    device: str = "auto"
    seed: int = 1337
    eval_interval: int = 250
    eval_batches: int = 20
    log_interval: int = 10
    sample_tokens: int = 200
    sample_prompt: str = "\n"
    time_limit: float = 0.0
    progress: bool = True

    def __post_init__(self) -> None:
        for f in ("batch_size", "grad_accum", "max_steps", "eval_interval", "eval_batches", "log_interval"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f}={getattr(self, f)} must be a positive integer.")
        for f in ("decay_steps", "warmup_steps", "threads", "sample_tokens"):
            if getattr(self, f) < 0:
                raise ValueError(f"{f}={getattr(self, f)} must be >= 0.")
        if self.tokenizer not in KINDS:
            raise ValueError(f"tokenizer={self.tokenizer!r} is not known; choose one of {', '.join(KINDS)}.")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r} is not known; choose one of {', '.join(PRECISIONS)}.")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device={self.device!r} is not known; choose auto, cpu or cuda.")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device={self.device!r} but this PyTorch sees no CUDA GPU; use device=cpu (or auto).")
        if not (self.lr > 0 and 0 <= self.min_lr <= self.lr):
            raise ValueError(f"need lr > 0 and 0 <= min_lr <= lr, got lr={self.lr}, min_lr={self.min_lr}.")


TRAIN_KEYS = tuple(f.name for f in dataclasses.fields(TrainConfig))
MODEL_KEYS = tuple(f.name for f in dataclasses.fields(TransformerConfig) if f.name not in ("name", "vocab_size"))


def cast_value(key: str, value: Any) -> Any:
    """Convert ``value`` (a ``--set`` string or a TOML value) to the type of field ``key``.

    Raises:
        ValueError: an unknown key (listing the valid ones) or a value of the wrong type.
    """
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    fields.update({f.name: f for f in dataclasses.fields(TransformerConfig) if f.name in MODEL_KEYS})
    if key not in fields:
        hint = " (it comes from the tokenizer; set bpe_vocab_size for BPE)" if key == "vocab_size" else ""
        raise ValueError(f"unknown setting {key!r}{hint}; valid keys are: {', '.join(sorted(fields))}.")
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
        if key == "mixer" and isinstance(value, str) and "," in value:   # a layer pattern: mamba,mamba,attention
            return [v.strip() for v in value.split(",")]
        return value if value is None or isinstance(value, list) else str(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key}={value!r} is not a valid {kind.split(' ')[0]}; e.g. --set {key}=...") from None
