"""Efficient attention vs dense: forward+backward time and peak memory against sequence length.

Contenders (bidirectional, 1 batch, 4 heads, d_head 64, fp32, the attention kernel alone):
dense math (materialises n x n), PyTorch's fused kernel, tformer flash, Longformer (w = 128, 256, 512
keys per side), BigBird (b = 64, r = 3), Performer (m = 64, 256), Linformer (k = 256).

Time: all contenders run in this one process, alternated (the order rotates every round), median
of ``--repeats`` rounds. A contender whose call took longer than ``--cap`` seconds stops growing n.
Memory (at ``--memory-lengths``): each (contender, n) runs once in a fresh subprocess reporting its peak resident memory
(``VmHWM``), minus a baseline subprocess that allocates the same inputs and warms up the code;
so the figure is what the length-n call itself needs.

Reports per contender the crossover length (the first n from which it is faster than flash at every
measured length) and the exponent of time and memory in n (least-squares slope of log t vs log n over
n >= 2048). Writes benchmarks/results/attention/efficient_attention.md and efficient_attention.png.

Run (one benchmark at a time on the shared machine; one thread: on a busy machine two OpenMP threads
wait on each other at every barrier, which punishes the kernels made of many small operations):
    flock /tmp/tformer-bench.lock env PYTHONPATH=$PWD/src OMP_NUM_THREADS=1 python benchmarks/attention/efficient_attention.py
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # benchmarks/, for common/
from common.record import Run, load_note, results_dir  # noqa: E402

HEADS, D = 4, 64
CONTENDERS = ["dense math", "torch fused", "tformer flash", "longformer w=128", "longformer w=256",
              "longformer w=512", "bigbird b=64 r=3", "performer m=64", "performer m=256", "linformer k=256"]


def make_call(name: str, n: int):
    """``(inputs, fn)``: fresh q, k, v (and any parameters) and the forward+backward call."""
    import torch

    from tformer import scaled_dot_product_attention as sdpa
    from tformer.ops.bigbird import bigbird_attention, random_blocks
    from tformer.ops.linformer import linformer_attention
    from tformer.ops.longformer import longformer_attention
    from tformer.ops.performer import favor_attention, gaussian_orthogonal, softmax_features

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, n, D, requires_grad=True) for _ in range(3))
    kind, _, arg = name.partition(" ")
    if kind == "dense":
        f = lambda: sdpa(q, k, v, backend="math")                           # noqa: E731
    elif kind == "torch":
        f = lambda: sdpa(q, k, v, backend="torch")                          # noqa: E731
    elif kind == "tformer":
        f = lambda: sdpa(q, k, v, backend="flash")                          # noqa: E731
    elif kind == "longformer":
        w = int(arg.split("=")[1])
        f = lambda: longformer_attention(q, k, v, w)                         # noqa: E731
    elif kind == "bigbird":
        table = random_blocks(n // 64, 3, HEADS, seed=0)
        f = lambda: bigbird_attention(q, k, v, 64, table)                    # noqa: E731
    elif kind == "performer":
        w = gaussian_orthogonal(int(arg.split("=")[1]), D)
        f = lambda: favor_attention(softmax_features(q, w, is_query=True),  # noqa: E731
                                    softmax_features(k, w, is_query=False), v)
    else:
        E, F = (torch.randn(1, 256, n, requires_grad=True) for _ in range(2))
        f = lambda: linformer_attention(q, k, v, E / 16, F / 16)             # noqa: E731
    return lambda: f().sum().backward()


def worker(name: str, n: int, baseline: bool) -> dict:
    """One memory point in a fresh process (``baseline``: inputs and warm-up only)."""
    make_call(name, 1024 if name.startswith("bigbird") else 256)()           # code, thread pools
    call = make_call(name, n)
    if not baseline:
        call()
    return {"peak_mb": peak_rss_mb()}


def peak_rss_mb() -> float:
    """This process's resident-memory high-water mark (VmHWM; ``ru_maxrss`` would include the parent's
    peak, which a child inherits at fork)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def memory_mb(name: str, n: int) -> float | None:
    def spawn(baseline: bool):
        cmd = [sys.executable, __file__, "--worker", name, str(n), str(int(baseline))]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        return json.loads(proc.stdout.splitlines()[-1])["peak_mb"] if proc.returncode == 0 else None
    full, base = spawn(False), spawn(True)
    return None if full is None or base is None else max(full - base, 0.0)


def slope(points: list[tuple[int, float]]) -> float | None:
    """Least-squares exponent of ``y ~ n^a`` over the points with n >= 2048 (at least 2)."""
    pts = [(math.log(n), math.log(y)) for n, y in points if n >= 2048 and y and y > 0]
    if len(pts) < 2:
        return None
    mx, my = statistics.fmean(p[0] for p in pts), statistics.fmean(p[1] for p in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)


def crossover(times: dict, name: str, lengths: list[int]) -> int | str:
    """First n from which ``name`` beats flash at every length both measured."""
    common = [n for n in lengths if n in times[name] and n in times["tformer flash"]]
    for i, n in enumerate(common):
        if all(times[name][m] < times["tformer flash"][m] for m in common[i:]):
            return n
    return "never (in range)"


def main() -> None:
    from tqdm import tqdm

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="512,1024,2048,4096,8192,16384")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cap", type=float, default=15.0, help="seconds per call beyond which n stops growing")
    p.add_argument("--memory-lengths", default="2048,4096",
                   help="lengths at which peak memory is measured (two subprocesses per contender each)")
    p.add_argument("--out", default=str(results_dir("attention") / "efficient_attention"))
    args = p.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    from tformer.machine import cpu_info

    cpu = cpu_info().model
    run = Run()
    load = run.busy_before
    times: dict[str, dict[int, float]] = {c: {} for c in CONTENDERS}
    mem: dict[str, dict[int, float]] = {c: {} for c in CONTENDERS}
    alive = set(CONTENDERS)
    for n in tqdm(lengths, desc="lengths"):
        calls = {c: make_call(c, n) for c in CONTENDERS if c in alive}
        samples: dict[str, list[float]] = {c: [] for c in calls}
        for r in range(args.repeats):
            order = list(calls)[r % len(calls):] + list(calls)[:r % len(calls)]
            for c in order:
                t0 = time.perf_counter()
                calls[c]()
                samples[c].append(time.perf_counter() - t0)
        for c, s in samples.items():
            times[c][n] = statistics.median(s)
            if times[c][n] > args.cap:
                alive.discard(c)
            if str(n) in args.memory_lengths.split(","):
                mem[c][n] = memory_mb(c, n)
        del calls
        write(times, mem, lengths, cpu, load, args, run)                     # after every length


def torch_threads() -> int:
    import torch
    return torch.get_num_threads()


def write(times, mem, lengths, cpu, load, args, run: Run) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"# Efficient attention: forward+backward, {HEADS} heads, d_head {D}, batch 1, fp32, bidirectional", "",
             f"CPU: {cpu}; {torch_threads()} torch thread(s); {load_note(load)}; medians of {args.repeats} "
             f"alternated rounds; memory = peak RSS",
             "of a fresh process minus a baseline process with the same inputs.", "",
             "Time (s) | " + " | ".join(f"n={n}" for n in lengths) + " | exponent | beats flash from", 
             "---|" + "---|" * (len(lengths) + 2)]
    for c in CONTENDERS:
        cells = [f"{times[c][n]:.3g}" if n in times[c] else "-" for n in lengths]
        e = slope(sorted(times[c].items()))
        x = "-" if c == "tformer flash" else crossover(times, c, lengths)
        lines.append(f"{c} | " + " | ".join(cells) + f" | {'-' if e is None else f'{e:.2f}'} | {x}")
    if any(mem[c] for c in CONTENDERS):
        lines += ["", "Peak memory (MB) | " + " | ".join(f"n={n}" for n in lengths) + " | exponent",
                  "---|" + "---|" * (len(lengths) + 1)]
        for c in CONTENDERS:
            cells = [f"{mem[c][n]:.0f}" if mem[c].get(n) is not None else "-" for n in lengths]
            e = slope(sorted((n, y) for n, y in mem[c].items() if y))
            lines.append(f"{c} | " + " | ".join(cells) + f" | {'-' if e is None else f'{e:.2f}'}")
    run.write(out.with_suffix(".md"), "\n".join(lines) + "\n")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for c in CONTENDERS:
        style = "--" if c in ("dense math", "torch fused", "tformer flash") else "-"
        for ax, data in zip(axes, (times, mem)):
            pts = sorted((n, y) for n, y in data[c].items() if y)
            if pts:
                ax.loglog(*zip(*pts), style, marker="o", ms=3, label=c)
    axes[0].set(xlabel="sequence length n", ylabel="forward+backward time (s)", title=f"Time ({cpu[:40]})")
    axes[1].set(xlabel="sequence length n", ylabel="peak memory above baseline (MB)", title="Memory")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    plt.close(fig)
    print("\n".join(lines))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        print(json.dumps(worker(sys.argv[2], int(sys.argv[3]), bool(int(sys.argv[4])))))
    else:
        main()
