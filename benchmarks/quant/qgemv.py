"""One-row block-quantised GEMV (q8_0 / q4_0 / q4_1, every kernel path this CPU runs) against torch's
bf16 ``F.linear`` and tformer's existing decode kernels, alternated in one run: µs and GB/s of weight
bytes read, per shape.

Shapes: GPT-2 124M's MLP (768->3072, 3072->768) and SmolLM2-135M's (576->1536 gate/up,
1536->576 down, 576->576 q/o, 576->192 k/v). Each shape is a set of copies (distinct memory, the
bf16 copies totalling ``--mb`` MB) so a pass streams weights as a decode step does rather than
re-reading one cached matrix; every contender's copies hold the same matrices. Per round every
contender makes one pass over its copies, in turn; the figures are medians over rounds, and the
ratios against bf16 ``F.linear`` are medians of the per-round ratios (so a load change between
rounds cancels). The result file records the commit, CPU and its flags, torch, threads, the load
before and after, and the command.

    flock -w 900 /tmp/tformer-bench.lock timeout 300 env PYTHONPATH=$PWD/src \\
        .venv/bin/python benchmarks/quant/qgemv.py [--threads 1 --tag 1thread]

Writes benchmarks/results/quant/qgemv[-TAG].md and .json.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from tformer.quant import blocks, gemv, qgemv
from tformer.quant.quantize import DecodeLinear, Int4Linear, Int8Linear, weight_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # benchmarks/, for common/
from common.record import Run  # noqa: E402

SHAPES = {"gpt2 fc 768->3072": (3072, 768), "gpt2 proj 3072->768": (768, 3072),
          "smollm2 up 576->1536": (1536, 576), "smollm2 down 1536->576": (576, 1536),
          "smollm2 q 576->576": (576, 576), "smollm2 kv 576->192": (192, 576)}
FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx_vnni",
         "avx512_bf16", "amx_int8", "amx_bf16")


class Block:
    """A q-format contender: packed blocks and a forced path (the op BlockLinear calls)."""

    def __init__(self, packed, fmt, path):
        self.packed, self.fmt, self.path = packed, fmt, path
        self.tiled = qgemv.tiles(packed, fmt, path)      # the SIMD paths' interleaved rows, made once (as BlockLinear)

    def __call__(self, x):
        return qgemv.qgemm(self.packed, self.fmt, x, None, self.path, self.tiled)


def nbytes(c) -> int:
    if isinstance(c, Block):
        return c.packed.nbytes
    if isinstance(c, Linear):
        return c.weight.nbytes
    return weight_bytes(c)


class Linear:
    """torch's bf16 ``F.linear`` on an (N, K) weight: the baseline."""

    def __init__(self, weight):
        self.weight = weight

    def __call__(self, x):
        return torch.nn.functional.linear(x, self.weight)


def contenders(n: int, k: int, copies: int, g: torch.Generator) -> dict[str, list]:
    """name -> ``copies`` callables on distinct memory holding the same (n, k) matrix."""
    lin = torch.nn.Linear(k, n, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) * 0.02)
    bf = lin.weight.detach().bfloat16()
    out = {"bf16 F.linear": [Linear(bf.clone()) for _ in range(copies)]}
    lin_bf = copy.deepcopy(lin).bfloat16()
    for kernel in ("mv", "ext"):
        if kernel == "ext" and gemv.load() is None:
            continue
        out[f"bf16 {kernel}"] = [DecodeLinear(copy.deepcopy(lin_bf), kernel=kernel) for _ in range(copies)]
    for name, cls, kernel in [("int8", Int8Linear, "int8pack"), ("int8", Int8Linear, "ext"),
                              ("int4", Int4Linear, "int4pack"), ("int4", Int4Linear, "ext")]:
        if kernel == "ext" and gemv.load() is None:
            continue
        one = cls(lin, kernel=kernel)
        out[f"{name} {kernel}"] = [copy.deepcopy(one) for _ in range(copies)]
    for fmt in blocks.FORMATS:
        packed = blocks.quantize(lin.weight, fmt)
        mats = [packed.clone() for _ in range(copies)]
        for p in qgemv.paths() or ("torch",):
            out[f"{fmt} {p}"] = [Block(m, fmt, p if p != "torch" else None) for m in mats]
    return out


@torch.inference_mode()
def run_shape(name: str, n: int, k: int, mb: float, rounds: int, g: torch.Generator) -> list[dict]:
    copies = max(1, int(mb * 2**20 / (2 * n * k)))
    runs = contenders(n, k, copies, g)
    x = {"bf16": torch.randn(1, k, generator=g).bfloat16(), "f32": torch.randn(1, k, generator=g)}
    times = {c: [] for c in runs}
    for r in range(rounds + 1):
        for c, fns in runs.items():
            xin = x["f32"] if c.startswith("q") else x["bf16"]
            t = time.perf_counter()
            for fn in fns:
                fn(xin)
            if r:                                                          # round 0 warms up
                times[c].append(time.perf_counter() - t)
    base = times["bf16 F.linear"]
    rows = []
    for c, fns in runs.items():
        sec = statistics.median(times[c]) / copies
        b = nbytes(fns[0])
        ratio = statistics.median(tb / tc for tb, tc in zip(base, times[c]))
        rows.append(dict(shape=name, kernel=c, copies=copies, us=sec * 1e6, bytes=b, gbs=b / sec / 1e9, speedup=ratio))
        print(f"  {name} {c}: {sec * 1e6:.1f} us, {b / sec / 1e9:.1f} GB/s, x{ratio:.2f} vs bf16 F.linear",
              file=sys.stderr, flush=True)
    del runs
    return rows


def cpu_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    have = set(line.split(":", 1)[-1].split())
    return [f for f in FLAGS if f in have]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--mb", type=float, default=96, help="bf16 MB of copies per shape (default 96)")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--tag", default="", help="result file name suffix: qgemv-TAG.md")
    p.add_argument("--out", default=None, help="result path (default benchmarks/results/quant/qgemv[-TAG].md)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    run = Run()
    qgemv.load()
    gemv.load()
    g = torch.Generator().manual_seed(0)
    t0 = time.time()
    rows = [r for s in args.shapes for r in run_shape(s, *SHAPES[s], args.mb, args.rounds, g)]
    run.finish()
    meta = dict(flags=cpu_flags(), loadavg_end=os.getloadavg(), qgemv_paths=list(qgemv.paths()),
                qgemv=qgemv.STATUS.get("state"), gemv=gemv.STATUS.get("state"), rounds=args.rounds, mb=args.mb,
                seconds=round(time.time() - t0, 1))
    lines = ["# Block-quantised one-row GEMV against bf16 F.linear and the existing decode kernels\n",
             f"CPU flags that matter: {' '.join(meta['flags'])}. 1/5/15-min load average at the end: "
             f"{', '.join(f'{v:.1f}' for v in meta['loadavg_end'])}. qgemv paths here: "
             f"{', '.join(meta['qgemv_paths']) or 'none (torch fallback)'}.\n",
             f"Each shape: copies on distinct memory totalling {args.mb:g} MB in bf16 (fewer bytes for the "
             f"quantised formats: the same matrices), one pass per contender per round, alternated, median of "
             f"{args.rounds} rounds. GB/s = weight bytes read (blocks incl. scales; int8/int4 incl. scales) / time. "
             "`x bf16` = median of the per-round ratios of bf16 F.linear's pass time to this one's (> 1: faster). "
             "q8_0/q4_0/q4_1 take float32 activations (quantised inside), the others bfloat16.\n"]
    for shape in args.shapes:
        lines += [f"\n## {shape}\n", "| kernel | bytes | µs | GB/s | x bf16 F.linear |", "|---|---:|---:|---:|---:|"]
        for r in rows:
            if r["shape"] == shape:
                lines.append(f"| {r['kernel']} | {r['bytes']} | {r['us']:.1f} | {r['gbs']:.1f} | {r['speedup']:.2f} |")
    text = "\n".join(lines) + "\n"
    if args.out:
        out = run.write(args.out, text)
        run.write_json(out.with_suffix(".json"), dict(meta=meta, rows=rows))
    else:
        out = run.write_result("quant", "qgemv", args.tag, text, dict(meta=meta, rows=rows))
    print(out.read_text(encoding="utf-8"))


if __name__ == "__main__":
    main()
