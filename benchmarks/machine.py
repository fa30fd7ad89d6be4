"""How busy the machine is right now, for the benchmarks' load check.

The 1-minute load average lags: just after one benchmark ends it still reads ~2 on an idle 2-core
machine, and flags the next run as busy. ``busy_cores`` (shared with the trainer's thread choice)
samples /proc/stat over a second while this process sleeps: that CPU time is other processes' work.
"""

from __future__ import annotations

import os

from tformer.machine import busy_cores  # noqa: F401  (re-exported for the scripts)

BUSY_CORES = 0.3  # more than this much of a core used by others: say the figures are noisy


def load_note(cores: float) -> str:
    """One phrase for a report: ``"0.02 of 2 cores busy with other work"`` plus a warning if busy."""
    text = f"{cores:.2f} of {os.cpu_count()} cores busy with other work (measured over 1 s)"
    return text + (" -- WARNING: the machine was busy; figures are noisy" if cores > BUSY_CORES else "")


def cpu_name() -> str:
    """The CPU's model name as ``lscpu`` reports it (``/proc/cpuinfo`` if lscpu is missing)."""
    import subprocess
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        out = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    for line in out.splitlines():
        if line.lower().startswith(("model name", "model name\t")):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"
