"""An IsoFLOP sweep: for a few compute budgets, train several model sizes each to exactly that budget.

For budget C and a model of N parameters, C = 6 N D fixes the tokens D, hence the optimizer
steps (D / tokens per step). Each run gets its own cosine schedule ending at its last step (the
lesson of Hoffmann et al. §3.1: a schedule longer than the run overstates the loss). Small
models see many tokens, large ones few; somewhere between, the final loss is lowest: that is the
compute-optimal size for C, and how it moves with C is the scaling law (see :mod:`.fit`).

N counts every parameter (embeddings included), as Hoffmann et al. did. The runs use
tformer's own :class:`~tformer.training.trainer.Trainer`. ``runs.json`` records each finished run
at once, so an interrupted sweep continues where it stopped (an unfinished run resumes from its
checkpoint if it saved one).
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from tformer.accounting import count_parameters
from tformer.checkpoint import read_pointer, resolve_checkpoint
from tformer.io import atomic_write_json
from tformer.training.runs import TRAINER_STATE
from tformer.config import TransformerConfig
from tformer.errors import ConfigError
from tformer.training.trainer import Trainer

# (n_layers, d_model, n_heads): each step about doubles the parameters; depth grows with width
# (d_model / n_layers between 16 and 32, the shallow end of Kaplan et al.'s flat region).
LADDER = [(1, 8, 1), (1, 12, 1), (1, 16, 1), (1, 24, 1), (1, 32, 2), (2, 32, 2), (2, 48, 3), (2, 64, 4), (3, 64, 4), (3, 96, 6),
          (4, 112, 7), (4, 128, 8), (5, 160, 8), (6, 192, 8), (6, 256, 8)]


@dataclass
class SweepSpec:
    """What a sweep trains. ``budgets`` in FLOPs (C = 6ND); ``sizes`` model sizes per budget."""

    budgets: list[float]
    sizes: int = 5
    spread: float = 16.0            # largest / smallest N of one budget
    center_tokens_per_param: float = 20.0
    context_length: int = 64
    batch_size: int = 16
    min_steps: int = 30
    settings: dict[str, Any] = field(default_factory=dict)   # extra TrainConfig / TransformerConfig fields
    ladder: list[tuple[int, int, int]] = field(default_factory=lambda: list(LADDER))

    def __post_init__(self) -> None:
        if len(self.budgets) < 2 or not all(math.isfinite(c) and c > 0 for c in self.budgets):
            raise ConfigError(f"a sweep needs at least 2 positive finite compute budgets, got {self.budgets}.")
        if not (math.isfinite(self.spread) and self.spread > 1):
            raise ConfigError(f"spread={self.spread} (--spread) must be a finite number > 1: the largest model of a "
                              f"budget over its smallest.")
        if not (math.isfinite(self.center_tokens_per_param) and self.center_tokens_per_param > 0):
            raise ConfigError(f"tokens per parameter {self.center_tokens_per_param} (--tokens-per-param) must be a "
                              f"positive finite number (Chinchilla's is 20).")
        for name in ("context_length", "batch_size", "min_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1.")
        if self.sizes < 3:
            raise ConfigError(f"sizes={self.sizes}: each budget needs at least 3 model sizes for its parabola.")
        self.budgets = sorted(float(c) for c in self.budgets)
        self.ladder = [tuple(r) for r in self.ladder]


QUICK = dict(budgets=[1.5e8, 3e8, 6e8], sizes=3, spread=6.0, context_length=16, batch_size=4, min_steps=10,
             ladder=[(1, 16, 1), (1, 24, 1), (1, 32, 2), (2, 32, 2), (2, 48, 3)],
             settings=dict(eval_batches=4, warmup_steps=2))


def ladder_configs(spec: SweepSpec, vocab_size: int) -> list[tuple[TransformerConfig, int]]:
    """The ladder as tiny-preset configs with the corpus' vocabulary, and their total parameters."""
    out = []
    for n_layers, d_model, n_heads in spec.ladder:
        model_kw = {k: v for k, v in spec.settings.items() if k in TransformerConfig.__dataclass_fields__}
        c = TransformerConfig.from_name("tiny", **{**model_kw, "n_layers": n_layers, "d_model": d_model,
                                                   "n_heads": n_heads, "context_length": spec.context_length,
                                                   "vocab_size": vocab_size})
        out.append((c, count_parameters(c).total))
    return out


def plan_runs(spec: SweepSpec, vocab_size: int) -> list[dict]:
    """Each budget's ``sizes`` ladder models nearest (in log N) to an even log grid around ``N*``.

    ``N* = sqrt(C / (6 · center_tokens_per_param))`` is where 20 tokens per parameter would put the
    optimum; the grid spans ``spread`` around it. Models that would get fewer than ``min_steps``
    steps are dropped (they would be measured before their warm-up is over).
    """
    ladder = ladder_configs(spec, vocab_size)
    tokens_per_step = spec.batch_size * spec.context_length
    runs = []
    for c in spec.budgets:
        center = math.sqrt(c / (6 * spec.center_tokens_per_param))
        targets = [center * spec.spread ** (i / (spec.sizes - 1) - 0.5) for i in range(spec.sizes)]
        chosen: list[int] = []
        for t in targets:
            order = sorted(range(len(ladder)), key=lambda i: abs(math.log(ladder[i][1] / t)))
            pick = next((i for i in order if i not in chosen), None)
            if pick is not None:
                chosen.append(pick)
        for i in sorted(chosen):
            config, n = ladder[i]
            steps = round(c / (6 * n * tokens_per_step))
            if steps < spec.min_steps:
                continue
            runs.append({"id": f"C{c:.3g}_L{config.n_layers}_d{config.d_model}", "budget": c,
                         "n_layers": config.n_layers, "d_model": config.d_model, "n_heads": config.n_heads,
                         "params": n, "non_embedding_params": count_parameters(config).non_embedding,
                         "steps": steps, "tokens": steps * tokens_per_step,
                         "flops": 6 * n * steps * tokens_per_step})
    return runs


def _trainer_class(bar):
    class SweepTrainer(Trainer):
        """The trainer, advancing the sweep's one progress bar at every step."""

        def _train_step(self, lr: float) -> float:
            loss = super()._train_step(lr)
            bar.update(1)
            return loss

        def _evaluate(self, metrics, _bar) -> None:
            super()._evaluate(metrics, _Quiet())           # the sweep prints one line per run instead
    return SweepTrainer


class _Quiet:
    def write(self, *args, **kwargs) -> None:
        pass


def _vocab_size(spec: SweepSpec) -> int:
    """The corpus' vocabulary (tokenising it once into the cache the runs then reuse)."""
    from tformer.training.data import load_corpus
    s = spec.settings
    corpus = load_corpus(s.get("data"), tokenizer=s.get("tokenizer", "char"), bpe_vocab_size=s.get("bpe_vocab_size", 1024),
                         val_fraction=s.get("val_fraction", 0.1), cache_dir=s.get("cache_dir"), log=lambda m: None)
    return corpus.tokenizer.vocab_size


def run_sweep(spec: SweepSpec, out: str | Path, *, progress: bool = True, log=print) -> dict:
    """Train every run of the sweep not yet in ``out/runs.json``; returns ``{"spec", "runs"}``, and
    ``"stopped"`` (the signal's name) when a stop signal ended a run before the sweep finished.

    Raises:
        ConfigError: ``out`` holds a sweep with a different spec (continue it with the same
            settings, or pick another folder), or fewer than three runs per budget fit the ladder.
    """
    from tqdm import tqdm

    out = Path(out)
    record_path = out / "runs.json"
    spec_dict = asdict(spec)
    spec_dict["ladder"] = [list(r) for r in spec.ladder]
    record = {"spec": spec_dict, "runs": {}}
    if record_path.exists():
        saved = json.loads(record_path.read_text(encoding="utf-8"))
        if saved["spec"] != spec_dict:
            raise ConfigError(f"{out} holds a sweep with other settings; rerun with the same settings to continue "
                              f"it, or choose another --out.")
        record = saved
    out.mkdir(parents=True, exist_ok=True)
    runs = plan_runs(spec, _vocab_size(spec))
    todo = [r for r in runs if r["id"] not in record["runs"]]
    if len(runs) < len(spec.budgets) * 3:
        raise ConfigError(f"only {len(runs)} runs fit the ladder with >= {spec.min_steps} steps; raise the budgets "
                          f"or lower min_steps.")
    log(f"sweep: {len(runs)} runs over {len(spec.budgets)} budgets, {len(runs) - len(todo)} already done")
    total = sum(r["steps"] for r in runs)
    bar = tqdm(total=total, initial=total - sum(r["steps"] for r in todo), unit="step", disable=not progress,
               dynamic_ncols=True, file=sys.stderr, desc="sweep")
    trainer_cls = _trainer_class(bar)
    try:
        for run in todo:
            bar.set_postfix_str(f"{run['id']} ({run['params']:,} params, {run['steps']} steps)")
            result = _train(trainer_cls, spec, run, out / "runs" / run["id"])
            if "stopped" in result:                             # a signal stopped it: keep what is done
                log(f"sweep interrupted during {run['id']}; rerun the same command to continue.")
                record["stopped"] = result["stopped"]           # which signal, for the exit status (not saved)
                break
            record["runs"][run["id"]] = {**run, **result}
            atomic_write_json(record_path, record)
            bar.write(f"{run['id']}: val loss {result['val_loss']:.4f} ({result['seconds']:.0f} s)")
    finally:
        bar.close()
    return record


def _train(trainer_cls, spec: SweepSpec, run: dict, folder: Path) -> dict:
    """The record of one finished run, or ``{"stopped": name}`` when a stop signal ended its training
    (``"int"``, ``"term"``: the loop's name for it, see :data:`tformer.exits.STOP_SIGNALS`)."""
    settings = {**spec.settings, "n_layers": run["n_layers"], "d_model": run["d_model"], "n_heads": run["n_heads"],
                "context_length": spec.context_length, "batch_size": spec.batch_size, "max_steps": run["steps"],
                "out_dir": str(folder), "eval_interval": run["steps"], "sample_tokens": 0, "progress": False}
    settings.setdefault("warmup_steps", max(1, min(100, run["steps"] // 10)))
    pointer = read_pointer(folder, missing_ok=True)
    resume = pointer is not None
    if resume and pointer["step"] == run["steps"]:
        return _finished(resolve_checkpoint(folder), folder)   # trained to the end, but not yet recorded
    if folder.exists() and not resume:
        shutil.rmtree(folder)                                   # an unfinished run with no checkpoint: start over
    trainer = trainer_cls.create(settings, preset="tiny", resume=resume, log=lambda m: None)
    summary = trainer.fit()
    if summary["stopped"]:
        return {"stopped": summary["stopped"]}
    final = next(h for h in reversed(summary["history"]) if "val_loss" in h)
    return {"val_loss": final["val_loss"], "train_loss": final["train_loss"], "seconds": trainer.elapsed,
            "threads": torch.get_num_threads()}


def _finished(checkpoint: Path, folder: Path) -> dict:
    """The record of a run whose last checkpoint is its final step: its last evaluation in metrics.jsonl."""
    state = json.loads((checkpoint / TRAINER_STATE).read_text(encoding="utf-8"))
    lines = (folder / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    final = next(r for r in map(json.loads, reversed(lines)) if "val_loss" in r)
    return {"val_loss": final["val_loss"], "train_loss": final["train_loss"], "seconds": state["elapsed_s"],
            "threads": torch.get_num_threads()}


def load_runs(out: str | Path) -> list[dict]:
    """The finished runs recorded in ``out/runs.json``, in budget then size order."""
    record = json.loads((Path(out) / "runs.json").read_text(encoding="utf-8"))
    return sorted(record["runs"].values(), key=lambda r: (r["budget"], r["params"]))
