"""Building tformer's C++ kernels: once per machine, at first use, with torch's fallback when that fails.

Each kernel library (``quant/gemv.cpp``, ``quant/qgemv.cpp``, ``ops/attention_cpu.cpp``) is compiled by
``torch.utils.cpp_extension.load`` into :func:`cache_dir` under a name that hashes its sources, so an
edited source or another torch rebuilds and later processes load the built library in milliseconds.
:func:`build_once` runs a library's build function once per process; any failure (no compiler, no
ninja, a CPU without the flags, ``TFORMER_NO_EXTENSION=1``) leaves ``None`` and the reason, and the
callers keep torch's kernels.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import threading
from pathlib import Path

import torch


def cache_dir() -> Path:
    """Where built kernels and the kernel choices live: ``$TFORMER_CACHE`` or ``~/.cache/tformer``."""
    return Path(os.environ.get("TFORMER_CACHE") or Path.home() / ".cache" / "tformer")


def cpu_flags() -> set[str]:
    """The flags of the first CPU in ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def build_once(build, held: list, lock: threading.Lock, status: dict[str, str]):
    """``build()``'s result, built by the first caller only (``held`` keeps it, ``lock`` makes the
    other threads wait); ``None`` when building fails, with the reason in ``status["state"]``: any
    failure (no compiler, no ninja, a flag the CPU lacks) means the caller keeps its torch fallback."""
    if not held:
        with lock:
            if not held:
                try:
                    held.append(build())
                    status["state"] = "built"
                except Exception as e:  # noqa: BLE001  any failure means: keep torch's kernels
                    held.append(None)
                    status["state"] = f"unavailable: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return held[0]


def find_ninja() -> str | None:
    """The ninja binary torch's builds need: on PATH, or the one beside this Python (a venv's, from the
    ``ninja`` wheel); ``None`` where there is neither."""
    beside = Path(sys.executable).with_name("ninja")
    return shutil.which("ninja") or (str(beside) if beside.is_file() and os.access(beside, os.X_OK) else None)


def source_digest(files: list[Path], flags: tuple[str, ...] = ("-O3", "-fopenmp")) -> str:
    """12 hex digits of the files' bytes, torch's version and the compiler flags: what a built library
    (and a speed measured with it) depends on."""
    return hashlib.sha256(b"".join(p.read_bytes() for p in files) + torch.__version__.encode()
                          + " ".join(flags).encode()).hexdigest()[:12]


def compile_library(name: str, sources: list[Path], headers: list[Path], what: str, *, needs: set[str] = frozenset(),
                    flags: tuple[str, ...] = ("-O3", "-fopenmp")):
    """``torch.ops.<name>``: the library built from ``sources`` (and the ``headers`` they include) in
    :func:`cache_dir`/``<name>-<hash of sources, headers, torch and flags>``, compiled the first time
    (saying so on stderr, naming ``what``) and loaded in milliseconds after.

    Raises:
        RuntimeError: ``TFORMER_NO_EXTENSION`` is set, or this CPU lacks one of the ``needs`` flags;
            whatever ``torch.utils.cpp_extension.load`` raises (no compiler, no ninja, a build error).
    """
    if os.environ.get("TFORMER_NO_EXTENSION"):
        raise RuntimeError("TFORMER_NO_EXTENSION is set")
    missing = set(needs) - cpu_flags()
    if missing:
        raise RuntimeError(f"this CPU has no {', '.join(sorted(missing))}")
    from torch.utils import cpp_extension       # imports setuptools: only when a build is due

    ninja = find_ninja()
    if ninja is not None and shutil.which("ninja") is None:
        # the ninja wheel (a dev dependency) puts its binary beside the venv's python, which is not on PATH
        # when the venv's python is run by its path (as `make test` does); torch looks for it on PATH
        os.environ["PATH"] = f"{os.path.dirname(ninja)}{os.pathsep}{os.environ.get('PATH', '')}"

    digest = source_digest([*sources, *headers], flags)
    short = name.removeprefix("tformer_")
    build = cache_dir() / f"{short}-{digest}"
    build.mkdir(parents=True, exist_ok=True)
    if not (build / f"{name}.so").exists():
        print(f"tformer: building {what} once for this machine into {build} (under a minute)", file=sys.stderr, flush=True)
    # -fopenmp: at::parallel_for is an OpenMP pragma in a header (a serial loop without it); the library
    # then shares the libgomp torch has already loaded (same soname)
    cpp_extension.load(name=name, sources=[str(p) for p in sources], build_directory=str(build),
                       extra_cflags=list(flags), extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    return getattr(torch.ops, name)
