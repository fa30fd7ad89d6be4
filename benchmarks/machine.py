"""How busy the machine is right now, for the benchmarks' load check.

The 1-minute load average lags: just after one benchmark ends it still reads ~2 on an idle 2-core
machine, and flags the next run as busy. Instead we sample /proc/stat over a second while this
process sleeps: whatever CPU time passes is other processes' work.
"""

from __future__ import annotations

import os
import time

BUSY_CORES = 0.3  # more than this much of a core used by others: say the figures are noisy


def _cpu_ticks() -> tuple[int, int]:
    with open("/proc/stat", encoding="ascii") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)          # idle + iowait
    return sum(fields[:8]) - idle, sum(fields[:8])                    # busy, total (no guest double count)


def busy_cores(seconds: float = 1.0) -> float:
    """Cores kept busy by other processes over the next ``seconds`` (falls back to the load average)."""
    try:
        b0, t0 = _cpu_ticks()
        time.sleep(seconds)
        b1, t1 = _cpu_ticks()
    except (OSError, ValueError, IndexError):
        return os.getloadavg()[0]
    return (b1 - b0) / max(t1 - t0, 1) * (os.cpu_count() or 1)


def load_note(cores: float) -> str:
    """One phrase for a report: ``"0.02 of 2 cores busy with other work"`` plus a warning if busy."""
    text = f"{cores:.2f} of {os.cpu_count()} cores busy with other work (measured over 1 s)"
    return text + (" -- WARNING: the machine was busy; figures are noisy" if cores > BUSY_CORES else "")
