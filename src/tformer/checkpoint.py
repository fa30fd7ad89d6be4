"""Saving and loading models: weights as safetensors, config as JSON, every write atomic.

A checkpoint is a folder::

    model.safetensors   the weights (a tied LM head is stored once, as the embedding)
    tformer_config.json {"model": class name, "config": TransformerConfig.to_dict(), "options": {...}}
    tokenizer.json      the tokenizer (see tformer.training.tokenizer), when there is one

Every file is written to a temporary name in the same folder, flushed to disk and renamed over
the old one (``os.replace`` is atomic on POSIX), so a run killed at any instant leaves either the
old file or the new one, never half of one.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file

from tformer.config import TransformerConfig

WEIGHTS, CONFIG = "model.safetensors", "tformer_config.json"


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Call ``write(tmp_path)`` then atomically move ``tmp_path`` to ``path``.

    Args:
        path: the final file.
        write: writes the complete file to the path it is given.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, sort_keys=True)
    atomic_write(path, write)


def _aliases(model: torch.nn.Module) -> set[str]:
    """State-dict names that repeat an earlier tensor (a tied LM head): stored once, restored by the tie."""
    seen, aliases = set(), set()
    for name, t in model.state_dict().items():
        (aliases.add(name) if t.data_ptr() in seen else seen.add(t.data_ptr()))
    return aliases


def _options(model: torch.nn.Module) -> dict[str, bool]:
    """Constructor switches beyond the config: the encoder's optional heads."""
    return {name: getattr(model, name) is not None for name in ("mlm_head", "pooler") if hasattr(model, name)}


def save_model(directory: str | os.PathLike, model: torch.nn.Module, generation: dict | None = None) -> None:
    """Write ``model.safetensors`` and ``tformer_config.json`` for a DecoderLM or EncoderModel.

    Args:
        generation: generation defaults to keep with the model, e.g. ``{"eos_token_id": [50256]}``.
    """
    directory = Path(directory)
    if any(getattr(m, "inference_only", False) for m in model.modules()):
        raise ValueError("this model was converted for inference (set_precision / quantize_int8); "
                         "save the model before converting it, and convert again after loading.")
    aliases = _aliases(model)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items() if k not in aliases}
    atomic_write(directory / WEIGHTS, lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))
    atomic_write_json(directory / CONFIG, {"model": model.config.model, "config": model.config.to_dict(),
                                           "options": _options(model), "generation": generation or {}})


def _read_meta(directory: str | os.PathLike) -> dict:
    path = Path(directory) / CONFIG
    if not path.is_file():
        hint = (" It looks like a HuggingFace folder: convert it with `tformer convert --from-hf DIR --out CKPT`."
                if (Path(directory) / "config.json").is_file() else
                " Pass the --out folder of `tformer train` or of `tformer convert --from-hf`.")
        raise ValueError(f"{directory} is not a tformer checkpoint: {CONFIG} is missing.{hint}")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(meta, dict) or not isinstance(meta.get("config"), dict):
            raise ValueError("no 'config' object in it")
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}. The checkpoint is damaged; retrain or restore it.") from e
    return meta


def load_generation_defaults(directory: str | os.PathLike) -> dict:
    """The generation defaults saved with a checkpoint (``{}`` if none), e.g. ``eos_token_id``."""
    return _read_meta(resolve_checkpoint(directory)).get("generation", {})


def load_config(directory: str | os.PathLike) -> tuple[TransformerConfig, str]:
    """Read ``tformer_config.json``: ``(config, model family)`` (a key of ``tformer.models.MODELS``)."""
    meta = _read_meta(directory)
    config = TransformerConfig.from_dict(meta["config"])
    return config, config.model


def load_model(directory: str | os.PathLike, map_location: str = "cpu") -> torch.nn.Module:
    """Build the model a checkpoint folder (or a training run folder: its latest step) describes
    and load its weights.

    Raises:
        ValueError: the folder, its config or its weights are missing, unreadable or do not fit.
    """
    from tformer.models import LEGACY_NAMES, MODELS, build_model

    directory = resolve_checkpoint(directory)
    meta = _read_meta(directory)
    config = TransformerConfig.from_dict(meta["config"])
    kind = LEGACY_NAMES.get(meta.get("model"), meta.get("model", config.model))
    if kind not in MODELS:
        raise ValueError(f"checkpoint model {kind!r} is not known; known: {', '.join(sorted(MODELS))}.")
    if kind != config.model:   # written before the config named its family
        config = TransformerConfig.from_dict({**meta["config"], "model": kind})
    model = build_model(config, **meta.get("options", {}))
    path = Path(directory) / WEIGHTS
    if not path.is_file():
        raise ValueError(f"{directory} has no {WEIGHTS}; the checkpoint is incomplete.")
    try:
        state = load_file(str(path), device=map_location)
    except Exception as e:  # safetensors raises its own error types
        raise ValueError(f"cannot read {path}: {e}. The file is damaged; retrain or restore it.") from e
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # a tensor of the wrong shape: weights and config disagree
        first = str(e).strip().splitlines()[-1].strip()
        raise ValueError(f"{path} does not fit its {CONFIG} ({first}); the checkpoint is damaged or its "
                         f"config was edited; use the config it was saved with.") from e
    missing = sorted(set(missing) - _aliases(model))
    if missing or unexpected:
        raise ValueError(f"{path} does not fit its {CONFIG}: missing {missing[:5]}, unexpected {unexpected[:5]}.")
    return model


# ------------------------------------------------------------------------------ training checkpoints
# A training run folder (``tformer train --out DIR``) holds one folder per saved step and a pointer:
#
#     DIR/ckpt/step-0000250/   model.safetensors, tformer_config.json, tokenizer.json,
#                              trainer.json (step, TrainConfig, corpus fingerprint),
#                              optimizer.pt (optimizer state + torch RNG, tensors only)
#     DIR/checkpoint.json      {"latest": "ckpt/step-0000250", "step": 250}
#
# A step folder is complete before the pointer moves to it (one atomic rename), so a run killed at
# any instant leaves the pointer on the last complete checkpoint.

POINTER, TRAINER_STATE, OPTIMIZER = "checkpoint.json", "trainer.json", "optimizer.pt"


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """The checkpoint folder for a run folder (its latest step) or a checkpoint folder itself.

    Raises:
        ValueError: the path is missing, unreadable, or not a tformer checkpoint.
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"checkpoint folder {path} does not exist; pass the --out folder of a `tformer train` run.")
    if not path.is_dir() or not os.access(path, os.R_OK | os.X_OK):
        raise ValueError(f"cannot read checkpoint folder {path}; pass a readable folder written by `tformer train`.")
    if (path / POINTER).is_file():
        try:
            latest = json.loads((path / POINTER).read_text(encoding="utf-8"))["latest"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"cannot read {path / POINTER}: {e}. The run folder is damaged; "
                             f"pass a checkpoint folder under {path / 'ckpt'} instead.") from e
        folder = path / latest
        if not (folder / CONFIG).is_file():
            raise ValueError(f"{path / POINTER} points to {folder}, which is not a complete checkpoint; "
                             f"pass another folder under {path / 'ckpt'}.")
        return folder
    if (path / CONFIG).is_file():
        return path
    raise ValueError(f"{path} is not a tformer checkpoint (no {POINTER} or {CONFIG}); "
                     f"pass the --out folder of a `tformer train` run.")


def save_training_checkpoint(run_dir: str | os.PathLike, step: int, model: torch.nn.Module, tokenizer,
                             state: dict, optimizer_state: dict, keep: int = 2) -> Path:
    """Write a complete step folder, then move the pointer to it; keep the newest ``keep`` folders.

    Args:
        state: JSON-able trainer state (step, configs, corpus fingerprint, ...).
        optimizer_state: tensors/numbers only (loaded back with ``weights_only=True``).
    Returns:
        The step folder.
    """
    run_dir = Path(run_dir)
    rel = f"ckpt/step-{step:07d}"
    folder = run_dir / rel
    pointer = run_dir / POINTER
    if pointer.is_file() and json.loads(pointer.read_text(encoding="utf-8")).get("latest") == rel:
        return folder                                       # this step is saved already
    if folder.exists():                                     # a partial folder from a killed run
        import shutil
        shutil.rmtree(folder)
    save_model(folder, model)
    tokenizer.save(folder / "tokenizer.json")
    atomic_write(folder / OPTIMIZER, lambda tmp: torch.save(optimizer_state, tmp))
    atomic_write_json(folder / TRAINER_STATE, state)
    atomic_write_json(pointer, {"latest": rel, "step": step})
    steps = sorted((p for p in (run_dir / "ckpt").iterdir() if p.name.startswith("step-")), key=lambda p: p.name)
    for old in steps[:-keep] if keep > 0 else []:
        if old != folder:
            import shutil
            shutil.rmtree(old, ignore_errors=True)
    return folder


def load_training_state(folder: str | os.PathLike) -> tuple[dict, dict]:
    """``(trainer state, optimizer state)`` of a checkpoint folder; the latter via ``weights_only=True``.

    Raises:
        ValueError: the files are missing or damaged.
    """
    folder = Path(folder)
    try:
        state = json.loads((folder / TRAINER_STATE).read_text(encoding="utf-8"))
        opt = torch.load(folder / OPTIMIZER, map_location="cpu", weights_only=True)
    except FileNotFoundError as e:
        raise ValueError(f"{folder} has no trainer state ({e.filename}); it was saved for inference only "
                         f"and cannot be resumed. Start a new run with another --out.") from e
    except Exception as e:
        raise ValueError(f"cannot read the trainer state in {folder}: {e}. The checkpoint is damaged; "
                         f"restore it or start a new run with another --out.") from e
    return state, opt
