"""The run folder's state on resume: a trainer state that can be trusted, and a metrics log that
matches the checkpoint it resumes from.

``metrics.jsonl`` is appended while training; a run killed after its last checkpoint has logged
steps that the resumed run will log again. So on resume the log is cut back to the checkpoint's
step (rewritten atomically), and a new run in a folder whose earlier run died before its first
checkpoint starts a new log instead of appending to the dead run's.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TypeVar

from tformer.checkpoint import SHARDS, resolve_checkpoint
from tformer.io import atomic_write
from tformer.errors import CheckpointError, ConfigError, InputError
from tformer.training.runs import load_training_state

METRICS = "metrics.jsonl"
Settings = TypeVar("Settings")

# trainer.json keys a resume reads, with the types they must have.
STATE_TYPES = {"step": int, "train_config": dict, "corpus_fingerprint": str, "tokens_seen": int,
               "elapsed_s": (int, float), "best_val_loss": (int, float)}


def check_state(state, opt_state, folder: Path) -> None:
    """Refuse a damaged trainer state (``trainer.json``, ``optimizer.pt`` as read) in one sentence."""
    if not isinstance(state, dict):
        raise CheckpointError(f"{folder}/trainer.json is not a JSON object; the checkpoint is damaged; restore it "
                              f"or start a new run with another --out.")
    for key, kind in STATE_TYPES.items():
        if key not in state or isinstance(state[key], bool) or not isinstance(state[key], kind):
            what = "lacks the key" if key not in state else f"has a {type(state[key]).__name__} for"
            raise CheckpointError(f"{folder}/trainer.json {what} {key!r}; the checkpoint is damaged or was edited; "
                                  f"restore it or start a new run with another --out.")
    if opt_state is None and (folder / SHARDS).is_dir():
        return                    # a sharded checkpoint: optimizer state and RNG are in shards/ (dist_checkpoint)
    if not isinstance(opt_state, dict) or not {"optimizer", "torch_rng"} <= set(opt_state):
        raise CheckpointError(f"{folder}/optimizer.pt lacks the optimizer state or the RNG state; the checkpoint "
                              f"is damaged; restore it or start a new run with another --out.")


def read_latest(run_dir: Path) -> tuple[Path, dict, dict | None]:
    """``(folder, trainer state, optimizer state)`` of ``run_dir``'s latest checkpoint, to resume from:
    the states read and checked (:func:`check_state`); the optimizer state is None for a sharded one."""
    folder = resolve_checkpoint(run_dir)
    state, opt_state = load_training_state(folder)
    check_state(state, opt_state, folder)
    return folder, state, opt_state


def check_more_steps(run_dir: Path, step: int, max_steps: int) -> None:
    """Refuse a resume that would train no step (it would print "trained N steps" and do nothing)."""
    if max_steps <= step:
        raise InputError(f"the run in {run_dir} is at step {step} already and max_steps={max_steps}, so resuming "
                         f"would train nothing; pass --set max_steps=N with N > {step}.")


def resumed_settings(cls: type[Settings], state: dict, asked: dict, keeps: tuple[str, ...], folder: Path,
                     run_dir: Path) -> Settings:
    """A resumed run's settings (``cls``, a TrainConfig dataclass): the checkpoint's (``state``'s
    ``train_config``, read from ``folder``) with ``asked`` over them, in ``run_dir``.

    Raises:
        ConfigError: ``asked`` changes one of ``keeps`` (what the checkpoint was made of: its data, its model).
        InputError: the run is at ``max_steps`` already (:func:`check_more_steps`).
    """
    saved = state["train_config"]
    changed = {k: v for k, v in asked.items() if k in keeps and v != saved.get(k)}
    if changed:
        raise ConfigError(f"the checkpoint in {folder} was trained with "
                          f"{', '.join(f'{k}={saved.get(k)!r}' for k in changed)}, but this run asks for "
                          f"{', '.join(f'{k}={v!r}' for k, v in changed.items())}; resume with the original "
                          f"settings or start a new run with another --out.")
    fields = {f.name for f in dataclasses.fields(cls)}
    s = cls(**{**{k: v for k, v in saved.items() if k in fields}, **asked, "out_dir": str(run_dir)})
    check_more_steps(run_dir, state["step"], s.max_steps)
    return s


def start_metrics(run_dir: Path, step: int | None) -> None:
    """Cut ``metrics.jsonl`` back to records of steps <= ``step``; ``None`` (a new run): remove it."""
    path = Path(run_dir) / METRICS
    if not path.is_file():
        return
    if step is None:
        path.unlink()
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line cut short by a kill
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= step:
            kept.append(line)

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in kept))

    atomic_write(path, write)
