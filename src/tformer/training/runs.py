"""A training run's step folders: written complete, then pointed at; read back for an exact resume.

The layout (a run folder, its ``ckpt/step-N`` folders and the ``checkpoint.json`` pointer) is
described in :mod:`tformer.checkpoint`, which also finds the latest complete step for readers.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from tformer.checkpoint import POINTER, SHARDS, read_pointer, save_model, write_model_config
from tformer.errors import CheckpointError
from tformer.io import atomic_write, atomic_write_json

TRAINER_STATE, OPTIMIZER = "trainer.json", "optimizer.pt"


def save_training_checkpoint(run_dir: str | os.PathLike, step: int, model: torch.nn.Module, tokenizer,
                             state: dict, optimizer_state: dict | None, keep: int = 2, weights: bool = True) -> Path:
    """Write a complete step folder, then move the pointer to it; keep the newest ``keep`` folders.

    Args:
        state: JSON-able trainer state (step, configs, corpus fingerprint, ...).
        optimizer_state: tensors/numbers only (loaded back with ``weights_only=True``); ``None`` when
            every rank has written the folder's ``shards/`` already (then ``weights`` says whether to
            add a consolidated ``model.safetensors`` from ``model``, else only its config is written).
    Returns:
        The step folder.
    """
    run_dir = Path(run_dir)
    rel = f"ckpt/step-{step:07d}"
    folder = run_dir / rel
    pointer = run_dir / POINTER
    if (read_pointer(run_dir, missing_ok=True) or {}).get("latest") == rel:
        return folder                                       # this step is saved already
    if optimizer_state is None:                             # sharded: shards/ is there already
        (save_model if weights else write_model_config)(folder, model)
    else:
        if folder.exists():                                 # a partial folder from a killed run
            shutil.rmtree(folder)
        save_model(folder, model)
        atomic_write(folder / OPTIMIZER, lambda tmp: torch.save(optimizer_state, tmp))
    tokenizer.save(folder / "tokenizer.json")
    atomic_write_json(folder / TRAINER_STATE, state)
    atomic_write_json(pointer, {"latest": rel, "step": step})
    steps = sorted((p for p in (run_dir / "ckpt").iterdir() if p.name.startswith("step-")), key=lambda p: p.name)
    for old in steps[:-keep] if keep > 0 else []:
        if old != folder:
            shutil.rmtree(old, ignore_errors=True)
    return folder


def load_training_state(folder: str | os.PathLike) -> tuple[dict, dict]:
    """``(trainer state, optimizer state)`` of a checkpoint folder; the latter via ``weights_only=True``
    (``None`` for a sharded checkpoint: its optimizer state is in ``shards/``).

    Raises:
        CheckpointError: the files are missing or damaged.
    """
    folder = Path(folder)
    try:
        state = json.loads((folder / TRAINER_STATE).read_text(encoding="utf-8"))
        sharded = (folder / SHARDS).is_dir()     # FSDP keeps its optimizer state in the shards
        opt = None if sharded else torch.load(folder / OPTIMIZER, map_location="cpu", weights_only=True)
    except FileNotFoundError as e:
        raise CheckpointError(f"{folder} has no trainer state ({e.filename}); it was saved for inference only "
                         f"and cannot be resumed. Start a new run with another --out.") from e
    except Exception as e:
        raise CheckpointError(f"cannot read the trainer state in {folder}: {e}. The checkpoint is damaged; "
                         f"restore it or start a new run with another --out.") from e
    return state, opt
