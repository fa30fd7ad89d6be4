"""Forward time of tformer flash / PyTorch's fused CPU kernel at n = 4096, causal (1 x 8 heads x d 64).

The ratio depends on how OpenMP threads wait on a busy machine, so run it under each setting:
    flock /tmp/tformer-bench.lock env PYTHONPATH=$PWD/src python benchmarks/attention_forward_ratio.py
    flock /tmp/tformer-bench.lock env OMP_WAIT_POLICY=PASSIVE PYTHONPATH=$PWD/src python benchmarks/attention_forward_ratio.py
    flock /tmp/tformer-bench.lock env PYTHONPATH=$PWD/src python benchmarks/attention_forward_ratio.py --threads 1
"""

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from machine import busy_cores, load_note  # benchmarks/machine.py
from tformer.ops.flash import flash_attention


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
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load = busy_cores()
    print(load_note(load))
    q, k, v = (torch.randn(1, 8, args.n, 64) for _ in range(3))
    with torch.no_grad():
        flash = median_time(lambda: flash_attention(q, k, v, causal=True), args.repeats)
        fused = median_time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), args.repeats)
    print(f"n={args.n} busy cores={load:.2f} OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'default')} "
          f"threads={torch.get_num_threads()}: flash {flash:.3f} s, fused {fused:.3f} s, ratio {flash / fused:.2f}")


if __name__ == "__main__":
    main()
