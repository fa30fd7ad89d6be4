"""One-row linear kernels on GPT-2 124M's decode GEMVs, alternated in one run: µs and GB/s per shape.

The weights are those of a whole GPT-2 124M decode step (12 layers of qkv 768->2304, out 768->768,
fc 768->3072, proj 3072->768, then the 768->50257 head), so each pass streams the model's weights as
a decode step does instead of re-reading one cached matrix. Success criterion, stated before the
run: a kernel is worth keeping for a dtype if its whole pass reads at >= 70% of the measured read
bandwidth (the issue's goal for bf16 and int8 decode), and its output equals a float64 reference to
the tolerance tests/quant/test_kernels.py states.

    flock /tmp/tformer-bench.lock env PYTHONPATH=$PWD/src .venv/bin/python benchmarks/quant/gemv.py

Writes benchmarks/results/quant/gemv.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from tformer.quant import gemv, kernels
from tformer.quant.quantize import decode_layer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # benchmarks/, for common/
from common.record import Run, load_note, results_dir  # noqa: E402
from common.measure import read_bandwidth  # noqa: E402

SHAPES = {"qkv 768x2304": (2304, 768), "out 768x768": (768, 768), "fc 768x3072": (3072, 768),
          "proj 3072x768": (768, 3072)}
HEAD = ("head 768x50257", (50257, 768))
SIMD = ["avx512", "avx2"]


def walk(layers: int) -> list[tuple[str, tuple[int, int]]]:
    return [(name, shape) for _ in range(layers) for name, shape in SHAPES.items()] + [HEAD]


def contenders(kind: str, shapes) -> dict[str, list]:
    """candidate -> the decode layer tformer builds with that kernel forced, one per weight of the walk;
    ``ext`` once per SIMD path this CPU runs (``ext-avx2``: the AVX2 loop, forced as on a CPU without
    AVX-512)."""
    g = torch.Generator().manual_seed(0)
    linears = [kernels.random_linear(n, k, g) for _, (n, k) in shapes]
    out = {}
    for c in kernels.available(kind):
        for simd in (SIMD if c == "ext" else [None]):
            old = os.environ.get(gemv.FORCED)
            if simd:
                os.environ[gemv.FORCED] = simd                 # read when the layer binds its op
            try:
                if simd is None or gemv.path() == simd:
                    out[c if simd is None else f"ext-{simd}"] = [decode_layer(kind, c, lin) for lin in linears]
            finally:
                os.environ.pop(gemv.FORCED, None) if old is None else os.environ.__setitem__(gemv.FORCED, old)
    return out


@torch.inference_mode()
def run(kind: str, layers: int, rounds: int) -> list[dict]:
    shapes = walk(layers)
    runs = contenders(kind, shapes)
    dtype = torch.bfloat16 if kind in ("int8", "int4") else kernels.DTYPES[kind]
    x = {k: torch.randn(1, k).to(dtype) for k in (768, 3072)}
    per = {c: {name: [] for name, _ in shapes} for c in runs}
    total = {c: [] for c in runs}
    for r in range(rounds + 1):
        for c, fns in runs.items():
            acc = {name: 0.0 for name, _ in shapes}
            t0 = time.perf_counter()
            for fn, (name, (n, k)) in zip(fns, shapes):
                t = time.perf_counter()
                fn(x[k])
                acc[name] += time.perf_counter() - t
            if r:
                total[c].append(time.perf_counter() - t0)
                for name in acc:
                    per[c][name].append(acc[name])
    bpw = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1, "int4": 0.5}[kind]
    rows = []
    for c in runs:
        row = dict(kind=kind, kernel=c, total_ms=statistics.median(total[c]) * 1e3)
        nbytes = sum(n * k for _, (n, k) in shapes) * bpw
        row["gbs"] = nbytes / statistics.median(total[c]) / 1e9
        for name, (n, k) in [*SHAPES.items(), HEAD]:
            count = layers if name in SHAPES else 1
            sec = statistics.median(per[c][name]) / count
            row[name] = (sec * 1e6, n * k * bpw / sec / 1e9)
        rows.append(row)
        print(f"  {kind} {c}: {row['total_ms']:.2f} ms per pass, {row['gbs']:.1f} GB/s", file=sys.stderr, flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--kinds", nargs="+", default=["fp32", "bf16", "fp16", "int8", "int4"])
    p.add_argument("--out", default=str(results_dir("quant") / "gemv.md"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    record = Run()
    print(load_note(record.busy_before), file=sys.stderr)
    bw = read_bandwidth()
    print(f"read bandwidth {bw:.1f} GB/s; extension: {gemv.load() is not None and 'built'} {gemv.STATUS}",
          file=sys.stderr)
    rows = [r for kind in args.kinds for r in run(kind, args.layers, args.rounds)]
    names = [*SHAPES, HEAD[0]]
    lines = ["# One-row GEMV kernels, GPT-2 124M decode shapes\n",
             f"Measured read bandwidth {bw:.1f} GB/s (x.sum() over 512 MB, best of 9). One pass = the "
             f"{args.layers}-layer walk + head; median of {args.rounds} alternated rounds. "
             f"`ext-avx512` / `ext-avx2` = tformer's loop (src/tformer/quant/gemv.cpp) on each SIMD path; the "
             f"AVX2 one forced on this CPU, with the rest of the machine as it is (an AVX2-only CPU differs in "
             f"more than its vectors).\n",
             "| dtype | kernel | pass ms | pass GB/s | share of read bw | " +
             " | ".join(f"{n} µs (GB/s)" for n in names) + " |",
             "|---|---|---:|---:|---:|" + "---:|" * len(names)]
    for r in rows:
        lines.append(f"| {r['kind']} | {r['kernel']} | {r['total_ms']:.2f} | {r['gbs']:.1f} | {r['gbs'] / bw:.0%} | "
                     + " | ".join(f"{r[n][0]:.0f} ({r[n][1]:.1f})" for n in names) + " |")
    text = "\n".join(lines)
    record.write(args.out, text + "\n")
    print(text)


if __name__ == "__main__":
    main()
