"""Building tformer's C++ kernels: once per machine, at first use, with torch's fallback when that fails.

Each kernel library (``quant/gemv.cpp``, ``quant/qgemv.cpp``, ``ops/attention_cpu.cpp``) is compiled by
``torch.utils.cpp_extension.load`` into :func:`cache_dir` under a name that hashes its sources, so an
edited source or another torch rebuilds and later processes load the built library in milliseconds.
:func:`build_once` runs a library's build function once per process; any failure (no compiler, no
ninja, a CPU without the flags, ``TFORMER_NO_EXTENSION=1``) leaves ``None`` and the reason, and the
callers keep torch's kernels.

Every build and load runs under :func:`build_lock`: an ``fcntl.flock`` on a file in the build folder,
which the kernel releases when its holder dies however it dies (kill -9, the OOM killer). torch's own
lock (a file ``lock`` that ``cpp_extension`` creates and deletes, and that a killed build leaves behind,
making every later load wait for ever) is removed under it once no process works in the folder (a
process of an older tformer, which takes no flock, may be building there). A built library is checked
before it is loaded (:func:`check_library`): one cut short (a killed link, a full disk: loading it died
with "Bus error") is deleted and built again.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import sys
import threading
import time
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


@contextlib.contextmanager
def build_lock(folder: Path, what: str):
    """Hold the build folder ``folder`` exclusively (other processes wait, saying so on stderr) and clear
    the lock file a killed ``cpp_extension`` build left there. The lock is an ``fcntl.flock``, which the
    kernel drops when the holding process dies, so a killed build never blocks the next one."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / ".tformer-build.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"tformer: waiting for another process that is building {what} in {folder}", file=sys.stderr,
                  flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        clear_stale_torch_lock(folder)
        yield
    finally:
        os.close(fd)                                   # releases the flock


QUIET_S = 2.0     # seconds with no process working in a build folder after which torch's lock there is stale


def _working_in(folder: Path) -> bool:
    """Whether another process runs in ``folder`` (torch runs ninja, and ninja the compiler, there)."""
    target, me = os.path.realpath(folder), str(os.getpid())
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit() and p != me]
    except OSError:
        return False
    for pid in pids:
        try:
            if os.readlink(f"/proc/{pid}/cwd") == target:
                return True
        except OSError:
            continue
    return False


def clear_stale_torch_lock(folder: Path) -> None:
    """Remove torch's lock file ``folder/lock`` once it is stale. tformer creates it only under
    :func:`build_lock`, so one found there was left by a build killed while it held it, or belongs to a
    process of an older tformer (no flock) building now: that one is waited for while a process works
    in the folder, and the file is removed after :data:`QUIET_S` seconds with none."""
    lock, quiet_since, said = folder / "lock", None, False
    while lock.exists():
        if _working_in(folder):
            quiet_since = None
        elif quiet_since is None:
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since >= QUIET_S:
            lock.unlink(missing_ok=True)
            print(f"tformer: removed {lock}, left by a kernel build that was killed", file=sys.stderr, flush=True)
            return
        if not said:
            print(f"tformer: {lock} exists: waiting to see whether a build is running there", file=sys.stderr,
                  flush=True)
            said = True
        time.sleep(0.1)


def check_library(path: Path) -> bool:
    """Whether the built library ``path`` is whole: an ELF file whose program segments and section table lie
    inside it. A library cut short (a link killed midway, a full disk) would map pages past its end and die
    with "Bus error" on first use, and ninja, seeing it newer than its objects, would never relink it; so
    a damaged one is deleted here (saying so) and the build makes it again. ``True`` when nothing was
    deleted (no library is fine too)."""
    if not path.exists() or not sys.platform.startswith("linux"):       # ELF: what Linux builds
        return True
    try:
        ok = _whole_elf(path)
    except OSError:
        ok = False
    if not ok:
        print(f"tformer: the built library {path} is damaged (cut short); building it again", file=sys.stderr,
              flush=True)
        path.unlink(missing_ok=True)
    return ok


def _whole_elf(path: Path) -> bool:
    """A 64-bit little-endian ELF file whose program segments and section header table (written last, at
    the end) all lie inside the file."""
    import struct

    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(64)
        if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
            return False
        phoff, shoff = struct.unpack_from("<QQ", head, 0x20)
        phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", head, 0x36)
        if phoff + phentsize * phnum > size or shoff + shentsize * shnum > size:
            return False
        f.seek(phoff)
        table = f.read(phentsize * phnum)
    for i in range(phnum):
        kind, _, offset, _, _, filesz = struct.unpack_from("<IIQQQQ", table, i * phentsize)
        if kind == 1 and offset + filesz > size:              # PT_LOAD: mapped from the file
            return False
    return True


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
    digest = source_digest([*sources, *headers], flags)
    short = name.removeprefix("tformer_")
    build = cache_dir() / f"{short}-{digest}"
    library = build / f"{name}.so"
    with build_lock(build, what):
        check_library(library)
        if library.exists():
            # built here before, from these very sources (the folder's name is their digest): load it as it is,
            # without torch's build step, which imports setuptools and runs ninja only to find nothing to do
            torch.ops.load_library(str(library))
            return getattr(torch.ops, name)
        from torch.utils import cpp_extension       # imports setuptools: only when a build is due

        ninja = find_ninja()
        if ninja is not None and shutil.which("ninja") is None:
            # the ninja wheel (a dev dependency) puts its binary beside the venv's python, which is not on PATH
            # when the venv's python is run by its path (as `make test` does); torch looks for it on PATH
            os.environ["PATH"] = f"{os.path.dirname(ninja)}{os.pathsep}{os.environ.get('PATH', '')}"
        print(f"tformer: building {what} once for this machine into {build} (under a minute)", file=sys.stderr,
              flush=True)
        # -fopenmp: at::parallel_for is an OpenMP pragma in a header (a serial loop without it); the library
        # then shares the libgomp torch has already loaded (same soname)
        for attempt in (1, 2):
            try:
                cpp_extension.load(name=name, sources=[str(p) for p in sources], build_directory=str(build),
                                   extra_cflags=list(flags), extra_ldflags=["-fopenmp"], is_python_module=False,
                                   verbose=False)
                break
            except FileNotFoundError as e:
                # an older tformer's process (no flock) built here at the same time and removed torch's lock
                # file, which torch then fails to remove: the library is built; load it again
                if attempt == 2 or Path(e.filename or "") != build / "lock":
                    raise
    return getattr(torch.ops, name)
