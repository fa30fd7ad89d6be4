"""Measurements that several benchmarks share (not part of the library: nothing in tformer uses them)."""

from __future__ import annotations

import time

import torch


def read_bandwidth(mb: int = 512, reps: int = 9) -> float:
    """GB/s of ``x.sum()`` over ``mb`` MB of float32: the rate a decode step can read weights.

    The best of ``reps`` runs: other processes on the machine only ever lower it, and a roofline
    fraction must not be computed against a depressed ceiling."""
    x = torch.randn(mb * 2**20 // 4)
    x.sum()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t)
    return x.nbytes / min(times) / 1e9
