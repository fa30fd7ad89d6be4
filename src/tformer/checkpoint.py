"""Saving and loading models: weights as safetensors, config as JSON, every write atomic.

A checkpoint is a folder::

    model.safetensors   the weights (a tied LM head is stored once, as the embedding)
    tformer_config.json {"model": family (a key of tformer.models.MODELS), "config": TransformerConfig.to_dict(), "options": {...}}
    tokenizer.json      the tokenizer (see tformer.tokenizers), when there is one

Every file is written to a temporary name in the same folder, flushed to disk and renamed over
the old one (``os.replace`` is atomic on POSIX), so a run killed at any instant leaves either the
old file or the new one, never half of one.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tformer.config import TransformerConfig
from tformer.errors import CheckpointError, InputError
from tformer.io import atomic_write, atomic_write_json, file_digest, start_digest
from tformer.models import LEGACY_NAMES, MODELS, build_model

WEIGHTS, CONFIG = "model.safetensors", "tformer_config.json"
CHECKSUM = "weights_sha256"  # key in tformer_config.json: SHA-256 of model.safetensors as saved


def _aliases(model: torch.nn.Module) -> set[str]:
    """State-dict names that repeat an earlier tensor (a tied LM head): stored once, restored by the tie."""
    seen, aliases = set(), set()
    for name, t in model.state_dict().items():
        (aliases.add(name) if t.data_ptr() in seen else seen.add(t.data_ptr()))
    return aliases


def _options(model: torch.nn.Module) -> dict[str, bool]:
    """Constructor switches beyond the config (the encoder's optional heads), as the model's family
    reads them from its weights (its ``options_from_state``; none if it has no such switches)."""
    family = type(model)
    return family.options_from_state(model.state_dict()) if hasattr(family, "options_from_state") else {}


def save_model(directory: str | os.PathLike, model: torch.nn.Module, generation: dict | None = None) -> None:
    """Write ``model.safetensors`` and ``tformer_config.json`` for a model of any family in ``tformer.models.MODELS``.

    Args:
        generation: generation defaults to keep with the model, e.g. ``{"eos_token_id": [50256]}``.
    """
    directory = Path(directory)
    if any(getattr(m, "inference_only", False) for m in model.modules()):
        raise InputError("this model was converted for inference (set_precision / quantize_int8); "
                         "save the model before converting it, and convert again after loading.")
    aliases = _aliases(model)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items() if k not in aliases}
    atomic_write(directory / WEIGHTS, lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))
    write_model_config(directory, model, generation, file_digest(directory / WEIGHTS))


def write_model_config(directory: str | os.PathLike, model: torch.nn.Module, generation: dict | None = None,
                       checksum: str | None = None) -> None:
    """Write ``tformer_config.json`` (with the weights' checksum; none for a sharded checkpoint,
    whose weights are in ``shards/``)."""
    atomic_write_json(Path(directory) / CONFIG, {"model": model.config.model, "config": model.config.to_dict(),
                                                 "options": _options(model), "generation": generation or {},
                                                 CHECKSUM: checksum})


def check_weights(path: Path, meta: dict, state: dict[str, torch.Tensor], model: torch.nn.Module,
                  digest: str | None = None) -> None:
    """Refuse weights that would load as a different model: a file changed since it was saved (its
    checksum; ``digest`` is the file's, if already computed), or a tensor whose stored dtype is not the
    kind the model holds (an I32 header on F32 bytes).
    """
    if meta.get(CHECKSUM) is not None and (digest or file_digest(path)) != meta[CHECKSUM]:
        raise CheckpointError(f"{path} does not match the checksum recorded in {CONFIG} when it was saved; "
                              f"the file was changed or damaged since; restore it or retrain.")
    expected = model.state_dict()
    for name, t in state.items():
        want = expected.get(name)
        if want is not None and (t.is_floating_point() != want.is_floating_point() or t.is_complex()):
            raise CheckpointError(f"{path}: tensor {name!r} is stored as {str(t.dtype)[6:]} but the model holds "
                                  f"{str(want.dtype)[6:]} there; the file is damaged or crafted; restore it or retrain.")


def check_finite(path: Path, model: torch.nn.Module) -> None:
    """Refuse a model with a NaN or infinite weight (it would generate garbage with exit status 0).

    A finite sum proves every element finite (one NaN or inf makes the sum NaN or inf), so the exact,
    slower count runs only for a tensor whose sum is not finite.
    """
    for name, t in model.state_dict().items():
        if t.is_floating_point() and t.numel() and not math.isfinite(float(t.sum())):
            bad = int((~torch.isfinite(t)).sum())
            if bad:
                raise CheckpointError(f"{path}: tensor {name!r} holds {bad} NaN or infinite value(s); the weights "
                                      f"are damaged (or training diverged before saving); use an earlier checkpoint.")


def read_sharded_weights(model: torch.nn.Module, shards: Path) -> torch.nn.Module:
    """``model`` (unsharded, in this one process) with the weights of a sharded checkpoint's ``shards/``."""
    from torch.distributed import checkpoint as dcp   # imported on use: it is slow to import and rarely needed
    state = {"model": model.state_dict()}
    try:
        with single_process_load():
            dcp.load(state, checkpoint_id=shards, no_dist=True)
    except Exception as e:
        raise CheckpointError(f"cannot read the sharded weights in {shards} ({first_line(e)}); "
                              f"restore the checkpoint or load another step folder.") from e
    model.load_state_dict(state["model"])
    return model


@contextlib.contextmanager
def single_process_load():
    """DCP warns when it reads without a process group; here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        yield


def damage(directory: str | os.PathLike) -> str | None:
    """Why checkpoint folder ``directory`` is not as it was saved (its config unreadable, its weights
    missing or not matching the checksum recorded with them, its ``tokenizer.json`` unreadable), or
    ``None`` when it is intact. Reads and hashes the files; builds no model."""
    directory = Path(directory)
    try:
        meta = _read_meta(directory)
    except CheckpointError as e:
        return first_line(e)
    path = directory / WEIGHTS
    if not path.is_file():
        return f"{WEIGHTS} is missing"
    if meta.get(CHECKSUM) is not None and file_digest(path) != meta[CHECKSUM]:
        return f"{WEIGHTS} does not match the checksum recorded in {CONFIG}"
    tokenizer = directory / "tokenizer.json"
    if tokenizer.exists():
        try:
            json.loads(tokenizer.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            return f"tokenizer.json cannot be read ({first_line(e)})"
    return None


def first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__


def _read_meta(directory: str | os.PathLike) -> dict:
    path = Path(directory) / CONFIG
    if not path.is_file():
        hint = (" It looks like a HuggingFace folder: convert it with `tformer convert --from-hf DIR --out CKPT`."
                if (Path(directory) / "config.json").is_file() else
                " Pass the --out folder of `tformer train` or of `tformer convert --from-hf`.")
        raise CheckpointError(f"{directory} is not a tformer checkpoint: {CONFIG} is missing.{hint}")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(meta, dict) or not isinstance(meta.get("config"), dict):
            raise CheckpointError("no 'config' object in it")
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}: {e}. The checkpoint is damaged; retrain or restore it.") from e
    return meta


def load_generation_defaults(directory: str | os.PathLike) -> dict:
    """The generation defaults saved with a checkpoint (``{}`` if none), e.g. ``eos_token_id``."""
    return _read_meta(resolve_checkpoint(directory)).get("generation", {})


def load_config(directory: str | os.PathLike) -> tuple[TransformerConfig, str]:
    """Read ``tformer_config.json``: ``(config, model family)`` (a key of ``tformer.models.MODELS``)."""
    meta = _read_meta(directory)
    config = TransformerConfig.from_dict(meta["config"])
    return config, config.model


def load_model(directory: str | os.PathLike, map_location: str = "cpu", verify: bool = True) -> torch.nn.Module:
    """Build the model a checkpoint folder (or a training run folder: its latest step) describes
    and load its weights.

    Args:
        verify: check the weights file's checksum (when the checkpoint records one), each tensor's
            dtype kind and that every weight is finite (:func:`check_weights`, :func:`check_finite`).

    Raises:
        CheckpointError: the folder, its config or its weights are missing, unreadable or do not fit.
    """
    directory = resolve_checkpoint(directory)
    meta = _read_meta(directory)
    digest = start_digest(Path(directory) / WEIGHTS) if verify and CHECKSUM in meta else None
    config = TransformerConfig.from_dict(meta["config"])
    kind = LEGACY_NAMES.get(meta.get("model"), meta.get("model", config.model))
    if kind not in MODELS:
        raise CheckpointError(f"checkpoint model {kind!r} is not known; known: {', '.join(sorted(MODELS))}.")
    if kind != config.model:   # written before the config named its family
        config = TransformerConfig.from_dict({**meta["config"], "model": kind})
    model = build_model(config, **meta.get("options", {}))
    path = Path(directory) / WEIGHTS
    if not path.is_file() and (Path(directory) / SHARDS).is_dir():   # a sharded (FSDP) training checkpoint
        model = read_sharded_weights(model, Path(directory) / SHARDS)
        if verify:
            check_finite(Path(directory) / SHARDS, model)
        return model
    if not path.is_file():
        raise CheckpointError(f"{directory} has no {WEIGHTS}; the checkpoint is incomplete.")
    try:
        state = load_file(str(path), device=map_location)
    except Exception as e:  # safetensors raises its own error types
        raise CheckpointError(f"cannot read {path}: {e}. The file is damaged; retrain or restore it.") from e
    if verify:
        check_weights(path, meta, state, model, digest.result() if digest else None)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # a tensor of the wrong shape: weights and config disagree
        first = str(e).strip().splitlines()[-1].strip()
        raise CheckpointError(f"{path} does not fit its {CONFIG} ({first}); the checkpoint is damaged or its "
                         f"config was edited; use the config it was saved with.") from e
    missing = sorted(set(missing) - _aliases(model))
    if missing or unexpected:
        raise CheckpointError(f"{path} does not fit its {CONFIG}: missing {missing[:5]}, unexpected {unexpected[:5]}.")
    if verify:
        check_finite(path, model)
    return model


# ------------------------------------------------------------------------------ training checkpoints
# A training run folder (``tformer train --out DIR``) holds one folder per saved step and a pointer:
#
#     DIR/ckpt/step-0000250/   model.safetensors, tformer_config.json, tokenizer.json,
#                              trainer.json (step, TrainConfig, corpus fingerprint),
#                              optimizer.pt (optimizer state + torch RNG, tensors only)
#     DIR/checkpoint.json      {"latest": "ckpt/step-0000250", "step": 250}
#
# A run sharded over several ranks (FSDP) keeps weights, optimizer state and RNG in shards/ instead
# (torch.distributed.checkpoint: one file per rank + .metadata, see tformer.training.dist_checkpoint);
# its last step also gets a consolidated model.safetensors.
#
# A step folder is complete before the pointer moves to it (one atomic rename), so a run killed at
# any instant leaves the pointer on the last complete checkpoint.

POINTER, SHARDS = "checkpoint.json", "shards"


def read_pointer(run_dir: str | os.PathLike, missing_ok: bool = False) -> dict | None:
    """A run folder's pointer ``{"latest": "ckpt/step-N", "step": N}``; ``None`` if there is none and ``missing_ok``.

    Raises:
        CheckpointError: the pointer is missing (unless ``missing_ok``), unreadable, or not of that form.
    """
    pointer = Path(run_dir) / POINTER
    try:
        data = json.loads(pointer.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        if missing_ok:
            return None
        raise CheckpointError(f"{pointer} is missing; pass the --out folder of a `tformer train` run.") from e
    except (OSError, ValueError) as e:
        data = e
    if not (isinstance(data, dict) and isinstance(data.get("latest"), str) and type(data.get("step")) is int):
        raise CheckpointError(f"{pointer} is damaged (expected {{\"latest\": \"ckpt/step-N\", \"step\": N}}); "
                              f"restore it or point it at a complete folder under {pointer.parent / 'ckpt'}.")
    return data


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """The checkpoint folder for a run folder (its latest step) or a checkpoint folder itself.

    Raises:
        CheckpointError: the path is missing, unreadable, or not a tformer checkpoint.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint folder {path} does not exist; pass the --out folder of a `tformer train` run.")
    if not path.is_dir() or not os.access(path, os.R_OK | os.X_OK):
        raise CheckpointError(f"cannot read checkpoint folder {path}; pass a readable folder written by `tformer train`.")
    if (path / POINTER).is_file():
        folder = path / read_pointer(path)["latest"]
        if not (folder / CONFIG).is_file():
            raise CheckpointError(f"{path / POINTER} points to {folder}, which is not a complete checkpoint; "
                             f"pass another folder under {path / 'ckpt'}.")
        return folder
    if (path / CONFIG).is_file():
        return path
    if (path / "config.json").is_file():
        raise CheckpointError(f"{path} is a HuggingFace model folder, not a tformer checkpoint; convert it first with "
                              f"`tformer convert --from-hf {path} --out CKPT` and pass CKPT.")
    if (path / "metrics.jsonl").is_file() or (path / "ckpt").is_dir():
        raise CheckpointError(f"{path} is a `tformer train` run folder that holds no complete checkpoint yet (the "
                              f"run stopped before its first save); train it longer or pass another folder.")
    raise CheckpointError(f"{path} is not a tformer checkpoint (no {POINTER} or {CONFIG}); "
                          f"pass the --out folder of a `tformer train` run.")
