"""The servers a serving benchmark compares: start one as a subprocess and wait until it answers;
percentiles of the timings.

A server's output goes to a temporary log file, not a pipe: a pipe nobody reads fills (64 KiB) and
then blocks the server's next write, which stalls it in the middle of a measurement.
"""

from __future__ import annotations

import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx


def start(cmd: list[str], port: int, env: dict, probe: str = "/health", timeout_s: float = 600) -> subprocess.Popen:
    """Run ``cmd`` and return once ``GET http://127.0.0.1:{port}{probe}`` answers 200.

    Raises:
        RuntimeError: it exited or did not answer within ``timeout_s``; the message ends with its log.
    """
    log = tempfile.NamedTemporaryFile("w+", prefix="bench-server-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}{probe}", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{cmd} did not start ({'exited' if proc.poll() is not None else 'timeout'}): "
                               f"{Path(log.name).read_text()[-2000:]}")
        time.sleep(0.5)


def concurrently(work, n: int) -> float:
    """Run ``work(i)`` for ``i < n`` on ``n`` threads at once (``n`` concurrent clients); the wall time, s."""
    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return time.perf_counter() - t


def pct(xs: list[float], q: float) -> float:
    """The ``q``-th percentile of ``xs`` (nearest rank; NaN for none)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")
