"""Forward time of tformer flash / PyTorch's fused CPU kernel at n = 4096, causal (1 x 8 heads x d 64).

The ratio depends on how OpenMP threads wait on a busy machine, so run it under each setting:
    flock /tmp/tformer-bench.lock env PYTHONPATH=$PWD/src python benchmarks/attention/attention_forward_ratio.py
    flock /tmp/tformer-bench.lock env OMP_WAIT_POLICY=PASSIVE PYTHONPATH=$PWD/src python benchmarks/attention/attention_forward_ratio.py
    flock /tmp/tformer-bench.lock env PYTHONPATH=$PWD/src python benchmarks/attention/attention_forward_ratio.py --threads 1

Writes benchmarks/results/attention/attention_forward_ratio[-PASSIVE][-1thread].md (one file per setting).
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tformer.ops.flash import flash_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # benchmarks/, for common/
from common.record import Run, load_note, results_dir  # noqa: E402


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=None, help="result file (default: one per OpenMP wait policy and thread count)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    run = Run()
    load = run.busy_before
    print(load_note(load))
    q, k, v = (torch.randn(1, 8, args.n, 64) for _ in range(3))
    with torch.no_grad():
        flash = median_time(lambda: flash_attention(q, k, v, causal=True), args.repeats)
        fused = median_time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), args.repeats)
    policy = os.environ.get("OMP_WAIT_POLICY", "default")
    line = (f"n={args.n} busy cores={load:.2f} OMP_WAIT_POLICY={policy} "
            f"threads={torch.get_num_threads()}: flash {flash:.3f} s, fused {fused:.3f} s, ratio {flash / fused:.2f}")
    print(line)
    suffix = ("" if policy == "default" else f"-{policy}") + ("" if not args.threads else f"-{args.threads}thread")
    out = args.out or results_dir("attention") / f"attention_forward_ratio{suffix}.md"
    run.write(out, f"# Forward time, tformer flash / PyTorch fused, causal, 1 x 8 heads x d 64, fp32\n\n"
                   f"Median of {args.repeats} after one warm-up each.\n\n"
                   f"| n | OMP_WAIT_POLICY | threads | flash s | fused s | flash / fused |\n|---:|---|---:|---:|---:|---:|\n"
                   f"| {args.n} | {policy} | {torch.get_num_threads()} | {flash:.3f} | {fused:.3f} | {flash / fused:.2f} |\n")


if __name__ == "__main__":
    main()
