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

import errno
import hashlib
import json
import math
import os
import re
import shutil
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file

from tformer.config import TransformerConfig
from tformer.errors import CheckpointError, InputError

WEIGHTS, CONFIG = "model.safetensors", "tformer_config.json"
CHECKSUM = "weights_sha256"  # key in tformer_config.json: SHA-256 of model.safetensors as saved


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Call ``write(tmp_path)`` then atomically move ``tmp_path`` to ``path``.

    The file gets the mode a plain ``open`` would give it (0666 less the umask), not the 0600 of
    the temporary file. A write that fails for lack of space (libraries report it in their own
    words: safetensors' ``SafetensorError``, torch's "unexpected pos", numpy's "N requested and M
    written") is raised as an ``OSError`` naming ``path``, for the command line to print as one line.

    Args:
        path: the final file.
        write: writes the complete file to the path it is given.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        try:
            write(tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        except Exception as e:
            raise _write_error(e, path, tmp) from e
        os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def current_umask() -> int:
    """The process's umask: from /proc on Linux (no race with other threads), else by setting it back."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _write_error(e: Exception, path: Path, tmp: str) -> Exception:
    """``e`` as an ``OSError`` naming ``path`` when it is a failed write (full disk, size limit), else ``e``."""
    if isinstance(e, OSError) and e.errno is not None:
        return e if e.filename not in (None, tmp) else OSError(e.errno, e.strerror, str(path))
    text = str(e)
    code = re.search(r"(?:os error |code: )(\d+)", text)
    if code:
        n = int(code.group(1))
        return OSError(n, os.strerror(n), str(path))
    if "unexpected pos" in text or re.search(r"\d+ requested and \d+ written", text):  # a short write
        n = errno.ENOSPC if shutil.disk_usage(path.parent).free < (64 << 20) else errno.EFBIG
        return OSError(n, f"{os.strerror(n)} (the file could not be written whole)", str(path))
    return e


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


def file_digest(path: str | os.PathLike) -> str:
    """SHA-256 of a file, read in 8 MiB blocks (about 1 GB/s on one core: see benchmarks/checksum_cost.py)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    return h.hexdigest()


def _start_digest(path: Path) -> Future | None:
    """:func:`file_digest` in a background thread (hashlib releases the GIL), overlapping the model's
    construction; ``None`` if there is no file to hash."""
    if not path.is_file():
        return None
    pool = ThreadPoolExecutor(max_workers=1)
    future = pool.submit(file_digest, path)
    pool.shutdown(wait=False)
    return future


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
    from tformer.models import LEGACY_NAMES, MODELS, build_model

    directory = resolve_checkpoint(directory)
    meta = _read_meta(directory)
    digest = _start_digest(Path(directory) / WEIGHTS) if verify and CHECKSUM in meta else None
    config = TransformerConfig.from_dict(meta["config"])
    kind = LEGACY_NAMES.get(meta.get("model"), meta.get("model", config.model))
    if kind not in MODELS:
        raise CheckpointError(f"checkpoint model {kind!r} is not known; known: {', '.join(sorted(MODELS))}.")
    if kind != config.model:   # written before the config named its family
        config = TransformerConfig.from_dict({**meta["config"], "model": kind})
    model = build_model(config, **meta.get("options", {}))
    path = Path(directory) / WEIGHTS
    if not path.is_file() and (Path(directory) / SHARDS).is_dir():   # a sharded (FSDP) training checkpoint
        from tformer.training.dist_checkpoint import read_sharded_weights
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

POINTER, TRAINER_STATE, OPTIMIZER, SHARDS = "checkpoint.json", "trainer.json", "optimizer.pt", "shards"


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
            import shutil
            shutil.rmtree(folder)
        save_model(folder, model)
        atomic_write(folder / OPTIMIZER, lambda tmp: torch.save(optimizer_state, tmp))
    tokenizer.save(folder / "tokenizer.json")
    atomic_write_json(folder / TRAINER_STATE, state)
    atomic_write_json(pointer, {"latest": rel, "step": step})
    steps = sorted((p for p in (run_dir / "ckpt").iterdir() if p.name.startswith("step-")), key=lambda p: p.name)
    for old in steps[:-keep] if keep > 0 else []:
        if old != folder:
            import shutil
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
