"""Files that are never half-written, and their digests.

Every file tformer writes goes through :func:`atomic_write`: written to a temporary name in the same
folder, flushed to disk and renamed over the old one (``os.replace`` is atomic on POSIX), so a
process killed at any instant leaves either the old file or the new one, never half of one.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Call ``write(tmp_path)`` then atomically move ``tmp_path`` to ``path``.

    The file gets the mode a plain ``open`` would give it (0666 less the umask), not the 0600 of
    the temporary file. A write that fails for lack of space (libraries report it in their own
    words: safetensors' ``SafetensorError``, torch's "unexpected pos", numpy's "N requested and M
    written") is raised as an ``OSError`` naming ``path``, for the command line to print as one line.

    A symlink is written through: its target is replaced (atomically, in the target's folder) and the
    link stays. A path that is not a regular file (a FIFO, a device such as ``/dev/null``, a socket, a
    folder) is refused before anything is written, rather than replaced by a plain file.

    Args:
        path: the final file.
        write: writes the complete file to the path it is given.
    """
    path = regular_target(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        try:
            write(tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        except Exception as e:
            raise write_error(e, path, tmp) from e
        os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


# What each kind of file that is not a regular one is called in a refusal.
FILE_KINDS = [(stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
              (stat.S_ISSOCK, "a socket")]


def regular_target(path: str | os.PathLike) -> Path:
    """The file a write to ``path`` should replace: ``path`` itself, or the end of its chain of symlinks.

    Raises:
        IsADirectoryError: the target is a folder.
        InputError: the target exists and is not a regular file (a FIFO, a device, a socket): replacing it
            by a plain file would destroy it (as root, ``/dev/null``).
    """
    from tformer.errors import InputError

    given = Path(path)
    target = Path(os.path.realpath(given)) if given.is_symlink() else given
    try:
        mode = os.stat(target).st_mode
    except OSError:          # missing (a new file), or not ours to judge (a permission, a loop): the write says
        return target
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(given))
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in FILE_KINDS if test(mode)), "not a regular file")
        via = f" (the link {given} points to {target})" if target != given else ""
        raise InputError(f"{target} is {kind}, not a regular file{via}; tformer writes whole files by replacing "
                         f"them, which would destroy it: write to a regular file instead.")
    return target


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


def write_error(e: Exception, path: Path, tmp: str) -> Exception:
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


def file_digest(path: str | os.PathLike) -> str:
    """SHA-256 of a file, read in 8 MiB blocks (its cost next to loading the weights:
    benchmarks/results/training/checksum_cost.md)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    return h.hexdigest()


def start_digest(path: Path) -> Future | None:
    """:func:`file_digest` in a background thread (hashlib releases the GIL), overlapping the model's
    construction; ``None`` if there is no file to hash."""
    if not path.is_file():
        return None
    pool = ThreadPoolExecutor(max_workers=1)
    future = pool.submit(file_digest, path)
    pool.shutdown(wait=False)
    return future
