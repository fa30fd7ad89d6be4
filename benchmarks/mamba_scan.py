"""Which selective scan is fastest on this CPU: loop (hand-written backward, or autograd's), recursive
doubling, chunked doubling, log space,
and mambapy's Blelloch scan (the PyPI peer), forward + backward at training shapes, in one run.

    flock /tmp/tformer-bench.lock env PYTHONPATH=$PWD/src OMP_NUM_THREADS=2 python benchmarks/mamba_scan.py

The contenders alternate within each repetition; the table gives medians and the ratio to the
loop. Writes benchmarks/results/mamba_scan.md. ``tformer.ssm.scan.FAST_SCAN`` names the winner.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import time
from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm

from machine import busy_cores, load_note  # benchmarks/machine.py
from tformer.ssm.scan import SCANS, discretise

RESULTS = Path(__file__).parent / "results"


def contenders() -> dict:
    out = {name: fn for name, fn in SCANS.items()}
    out["chunked-8"] = partial(SCANS["chunked"], chunk=8)
    try:
        from mambapy.pscan import pscan
        out["mambapy pscan"] = lambda a, b: pscan(a, b)
    except ImportError:
        pass
    return out


def inputs(batch: int, T: int, E: int, N: int):
    x, delta = torch.randn(batch, T, E), torch.nn.functional.softplus(torch.randn(batch, T, E) - 3)
    A, B = -torch.rand(E, N) * N, torch.randn(batch, T, N)
    a, b = discretise(x, delta, A, B)
    return a.requires_grad_(), b.requires_grad_()


def time_once(fn, a, b, backward: bool) -> float:
    t = time.perf_counter()
    h = fn(a, b)
    if backward:
        h.sum().backward()
    return time.perf_counter() - t


def main(reps: int = 5) -> None:
    cpu = subprocess.run("lscpu | grep 'Model name'", shell=True, capture_output=True, text=True).stdout.split(":")[-1]
    note = load_note(busy_cores())
    shapes = [(32, 72, 128, 16), (16, 256, 128, 16), (2, 1024, 128, 16)]
    fns = contenders()
    lines = ["# Selective scan on CPU: which algorithm is fastest", "",
             f"CPU: {cpu.strip()}, torch {torch.__version__}, {torch.get_num_threads()} threads; {note}", "",
             f"Median of {reps} alternating repetitions; forward + backward of all states ``(Bt, T, E, N)`` "
             f"from precomputed ``a = exp(ΔA)``, ``b = ΔBx``; ratio = loop time / contender time.", "",
             "| shape (Bt, T, E, N) | scan | fwd+bwd ms | x loop | fwd ms | x loop |", "|---|---|---:|---:|---:|---:|"]
    for shape in shapes:
        a, b = inputs(*shape)
        times = {(n, bw): [] for n in fns for bw in (True, False)}
        for _ in tqdm(range(reps), desc=str(shape)):
            for name, fn in fns.items():
                for bw in (True, False):
                    a.grad = b.grad = None
                    if bw:
                        times[(name, bw)].append(time_once(fn, a, b, True))
                    else:
                        with torch.no_grad():
                            times[(name, bw)].append(time_once(fn, a, b, False))
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        for name in fns:
            lines.append(f"| {shape} | {name} | {med[(name, True)]:.1f} | {med[('loop', True)] / med[(name, True)]:.2f} "
                         f"| {med[(name, False)]:.1f} | {med[('loop', False)] / med[(name, False)]:.2f} |")
    lines += ["", f"Load after the run: {load_note(busy_cores())}"]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "mamba_scan.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(int(os.environ.get("REPS", 5)))
