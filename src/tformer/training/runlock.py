"""One process per run folder: an advisory lock on ``<run folder>/.lock``.

Two ``tformer train`` runs writing the same ``--out`` would interleave their step folders and
``metrics.jsonl``, and one run's cleanup of "partial" step folders would delete the other's save.
So a run takes an exclusive ``flock`` on a file in its folder before it reads or writes anything
there, and a second run is refused in one sentence naming the holder's process id.

The kernel releases a ``flock`` when its file descriptor closes, so the lock goes away when the
process ends however it ends (exit, exception, ``kill -9``, a crash): a stale ``.lock`` file from
a dead run never blocks the next one. POSIX only (``fcntl``); on a system without it, no lock.
Under ``torchrun`` the ranks of one run share its folder: only rank 0 (``RANK`` unset or 0) locks it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, TypeVar

from tformer.errors import InputError

try:
    import fcntl
except ImportError:  # Windows: runs are not protected against each other
    fcntl = None

LOCK = ".lock"
Run = TypeVar("Run")


class RunLock:
    """An exclusive lock on a run folder, held until :meth:`release` or the end of the process.

    Args:
        folder: the run folder (created if missing).
    Raises:
        InputError: another live process holds the folder.
    """

    def __init__(self, folder: str | os.PathLike):
        self.path = Path(folder) / LOCK
        self.fd: int | None = None
        if fcntl is None or os.environ.get("RANK", "0") != "0":
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(self.fd)
            self.fd = None
            raise InputError(f"{self.path.parent} is in use by another `tformer train` (process {holder}); wait for "
                             f"it to finish, stop it, or pass another --out.") from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        """Give the folder up (also happens when the process ends)."""
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def check_run_folder(folder: Path) -> None:
    """Refuse an ``--out`` that is a file: a run lives in a folder."""
    if folder.exists() and not folder.is_dir():
        raise InputError(f"--out {folder} is a file, not a folder; pass a folder for the run.")


def locked_run(folder: Path, start: Callable[[], Run]) -> Run:
    """The run ``start()`` builds, under the lock of ``folder``: released when ``start`` fails, else handed
    to the run (its ``lock``), which holds it to its end."""
    lock = RunLock(folder)
    try:
        run = start()
    except BaseException:
        lock.release()
        raise
    run.lock = lock
    return run
