"""A/B runs of one set of workloads on two checkouts, alternated (the harness behind
``ab/ab_compare.py`` and ``interp/hooks_cost.py``).

Each workload is a Python snippet that prints ``{"value": number}`` (higher is better); it runs in a
fresh subprocess with its checkout's ``src`` first on the path, so each side imports only its own
code. Each round runs every workload once on each side, and the order flips every round, so both
sides see the machine at nearly the same moment and drift in load falls on both.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path


def run_workload(checkout: Path, code: str, threads: int, timeout: float = 1800) -> float:
    """The number ``code`` prints when run with ``checkout``'s tformer on ``threads`` threads."""
    env = {**os.environ, "PYTHONPATH": str(checkout.resolve() / "src"), "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    if out.returncode:
        raise SystemExit(f"workload failed in {checkout}:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["value"]


def alternate(workloads: dict[str, str], a: Path, b: Path, rounds: int, threads: int,
              timeout: float = 1800) -> dict[str, dict[str, list[float]]]:
    """``{name: {"A": [value per round], "B": [...]}}``: every workload on both sides, each round,
    A first in even rounds and B first in odd ones."""
    values = {n: {"A": [], "B": []} for n in workloads}
    for r in range(rounds):
        for n, code in workloads.items():
            for side in (("A", "B") if r % 2 == 0 else ("B", "A")):
                values[n][side].append(run_workload(a if side == "A" else b, code, threads, timeout))
        print(f"round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
    return values


def ratio_stats(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """``(B/A of the medians, min, max of the per-round B/A)``: the ratio and the noise to judge it by."""
    ratios = [y / x for x, y in zip(a, b)]
    return statistics.median(b) / statistics.median(a), min(ratios), max(ratios)
