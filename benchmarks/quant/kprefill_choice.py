"""Which several-row product a K-quant / Q5 prompt should run (issue 47: "repacked or dequantise-then-GEMM,
whichever is faster here, chosen by measurement"): GMAC/s of one (M x K) . (N x K)^T product at 1 thread in
Qwen2.5-0.5B's two MLP shapes (4864x896, 896x4864), for

- ``F.linear`` in float32 and in bfloat16 (oneDNN; this CPU has AVX512_BF16) on a weight already widened:
  the dequantise-then-GEMM path without its dequantisation, an upper bound on its speed;
- the Q8_0 tile kernel (``qgemv.qgemm`` on repacked tiles: what a one-time repack to 8-bit tiles would run);
- ``qgemv.kqgemm`` on the file layout for q5_0 / q5_1 / q4_k / q5_k / q6_k at M rows: the widened tiles of
  quant/kprefill.h from ``WIDEN_ROWS`` (32) rows, the one-row kernels below it.

Medians of 5 calls after one warm-up, each shape's candidates alternated.

    flock /tmp/tformer-bench.lock env PYTHONPATH=src .venv/bin/python benchmarks/quant/kprefill_choice.py --tag s5

Writes benchmarks/results/quant/kprefill_choice[-TAG].md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # benchmarks/, for common/
from common.record import Run  # noqa: E402

SHAPES = {"q5_0": (4864, 896), "q5_1": (4864, 896), "q4_k": (896, 4864), "q5_k": (896, 4864), "q6_k": (896, 4864)}


def seconds(fn, calls: int = 5) -> float:
    fn()
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 31, 32, 64, 128])
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    from tformer.quant import blocks, kblocks, qgemv
    torch.set_num_threads(1)
    run = Run()
    path = qgemv.path()
    g = torch.Generator().manual_seed(0)
    lines = ["# K-quant / Q5 prompt products: which path", "",
             f"GMAC/s at 1 thread, kernel path `{path}`; medians of 5 calls. `fp32` / `bf16`: `F.linear` on a weight "
             "already widened (dequantise-then-GEMM without its dequantisation); `q8_0 tiles`: the tile kernel on "
             "repacked Q8_0; `file layout`: `qgemv.kqgemm` (widened tiles from 32 rows, the one-row kernels below).", "",
             "| format | N x K | rows | fp32 | bf16 | q8_0 tiles | file layout |", "|---|---|---:|---:|---:|---:|---:|"]
    for fmt, (n, k) in SHAPES.items():
        packed = kblocks.random_blocks(n, k, fmt, g)
        w = kblocks.dequantize(packed, fmt)
        wb = w.bfloat16()
        q8 = blocks.quantize(w, "q8_0")
        tiles = qgemv.tiles(q8, "q8_0", path)
        for m in args.rows:
            x = torch.randn(m, k, generator=g)
            xb = x.bfloat16()
            t = {"fp32": seconds(lambda: F.linear(x, w)), "bf16": seconds(lambda: F.linear(xb, wb)),
                 "q8": seconds(lambda: qgemv.qgemm(q8, "q8_0", x, None, path, tiles)),
                 "file": seconds(lambda: qgemv.kqgemm(packed, fmt, x, None, path))}
            r = {c: m * n * k / s / 1e9 for c, s in t.items()}
            lines.append(f"| {fmt} | {n} x {k} | {m} | {r['fp32']:.1f} | {r['bf16']:.1f} | {r['q8']:.1f} | {r['file']:.1f} |")
            print(lines[-1], flush=True)
    run.finish()
    print(run.write_result("quant", "kprefill_choice", args.tag, "\n".join(lines) + "\n").read_text())


if __name__ == "__main__":
    main()
