"""The tile kernels of ``qgemv.cpp`` in isolation, at SmolLM2-135M's shapes: GB/s of weight bytes
streamed per format, kernel path, activation rows M and threads, this tree's kernels against an
earlier revision's in the same process, alternated.

What is timed: ``tformer_qgemv::tile_passes``, a C++ loop of ``tile_product`` calls over matrices
held as tiles (the layout BlockLinear and the whole-layer call run on), with the activations
quantised before the clock starts, so the figure is the kernels' and tile_product's own: no Python,
dispatch or allocation. Matrices (K -> N): qkv 576->960, o 576->576, gate and up 576->1536, down
1536->576 (30 copies each on distinct memory, as a decode step reads 30 layers), ``step`` = the 30
layers' 150 products in decode order, ``head`` = the tied 576->49152 LM head (one copy), ``o-l2`` one
o matrix (0.2-0.4 MB, in L2: the kernels' compute rate, no memory stream). Weights are
random, quantised with ggml's rounding (:func:`tformer.quant.blocks.quantize`).

A/B: ``--against REV`` builds REV's ``qgemv.cpp`` as a second library (its op namespace renamed
``tformer_qgemv_ref``; REV must have ``tile_passes``), each side's tiles made by its own repack;
per round each side makes one timed call (``--reps`` passes) per configuration, in turn; figures
are medians over rounds, the ratio the median of per-round ratios (> 1: this tree faster).

llama.cpp's reference is its whole decode step (it has no per-kernel figure here): bytes of the
GGUF tensors a token reads x its decode tok/s (benchmarks/results/quant/smollm2_llama_cpp*.md) is
a lower bound on its kernels' rate, since its step also runs attention, norms and the graph.

    flock -w 900 /tmp/tformer-bench.lock timeout 300 env PYTHONPATH=$PWD/src .venv/bin/python \\
        benchmarks/quant/tile_kernels.py \\
        --against REV --threads 1 --tag 1thread

Writes benchmarks/results/quant/tile_kernels[-TAG].md and .json.
"""

from __future__ import annotations

import argparse
import hashlib
import posixpath
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from tformer.extensions import cache_dir
from tformer.quant import blocks, qgemv

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # benchmarks/, for common/
from common.record import ROOT, Run  # noqa: E402

LAYERS = 30
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate": (1536, 576), "up": (1536, 576), "down": (576, 1536)}
ORDER = ("qkv", "o", "gate", "up", "down")                           # a layer's products, in decode order
HEAD = (49152, 576)


def reference_ops(rev: str):
    """``torch.ops.tformer_qgemv_ref``: ``rev``'s qgemv.cpp built as a second library, beside the
    headers it includes (``tiles.h`` since the whole-layer code left it; ``float_rows.h`` and
    ``ops/vec_*.h`` before), each as ``rev`` has it."""
    from torch.utils import cpp_extension

    def show(path: str) -> str:
        return subprocess.run(["git", "show", f"{rev}:src/tformer/{path}"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout

    text = show("quant/qgemv.cpp")
    if "tile_passes" not in text:
        sys.exit(f"tile_kernels: {rev}'s qgemv.cpp has no tile_passes op; pick a revision that has it.")
    text = text.replace("tformer_qgemv", "tformer_qgemv_ref")
    headers = {}                                       # path under src/tformer -> text, found from the includes
    todo = [("quant", text)]
    while todo:
        folder, body = todo.pop()
        for name in re.findall(r'^#include "([^"]+)"', body, re.M):
            path = posixpath.normpath(posixpath.join(folder, name))
            if path not in headers:
                headers[path] = show(path)
                todo.append((posixpath.dirname(path), headers[path]))
    digest = hashlib.sha256((text + "".join(headers[k] for k in sorted(headers))).encode()).hexdigest()[:12]
    build = cache_dir() / f"qgemv-ref-{digest}"
    src = build / "quant" / "qgemv_ref.cpp"
    if not src.exists():
        for path, body in headers.items():
            (build / path).parent.mkdir(parents=True, exist_ok=True)
            (build / path).write_text(body, encoding="utf-8")
        src.parent.mkdir(parents=True, exist_ok=True)
        src.write_text(text, encoding="utf-8")
    cpp_extension.load(name="tformer_qgemv_ref", sources=[str(src)], build_directory=str(build),
                       extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"], is_python_module=False)
    return torch.ops.tformer_qgemv_ref


def workloads(fmt: str, g: torch.Generator) -> dict[str, list[tuple[torch.Tensor, int]]]:
    """name -> [(packed blocks, N)] in pass order; copies share content but not memory."""
    one = {s: blocks.quantize(torch.randn(*SHAPES[s], generator=g) * 0.02, fmt) for s in SHAPES}
    copies = {s: [one[s].clone() for _ in range(LAYERS)] for s in SHAPES}
    out = {s: [(m, SHAPES[s][0]) for m in copies[s]] for s in SHAPES}
    out["step"] = [(copies[s][i], SHAPES[s][0]) for i in range(LAYERS) for s in ORDER]   # the same memory, reordered
    out["o-l2"] = out["o"][:1]                                                    # one copy: in L2
    out["head"] = [(blocks.quantize(torch.randn(*HEAD, generator=g) * 0.02, fmt), HEAD[0])]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--against", default=None, help="a revision whose kernels run alongside (A/B)")
    p.add_argument("--threads", type=int, nargs="+", default=[1])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8], help="activation rows M")
    p.add_argument("--formats", nargs="+", default=list(blocks.FORMATS), choices=list(blocks.FORMATS))
    p.add_argument("--paths", nargs="+", default=None, help="kernel paths (default: the SIMD paths this CPU runs)")
    p.add_argument("--shapes", nargs="+", default=["step", "head", "o-l2", *SHAPES], choices=["step", "head", "o-l2", *SHAPES])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=3, help="passes per timed call")
    p.add_argument("--tag", default="")
    args = p.parse_args()
    run = Run()
    ops = {"new": qgemv.load()}
    if ops["new"] is None:
        sys.exit(f"tile_kernels: the kernels are {qgemv.STATUS.get('state')}")
    if args.against:
        ops["ref"] = reference_ops(args.against)
    paths = args.paths or [q for q in qgemv.paths() if q in qgemv.TILE_ROWS]
    g = torch.Generator().manual_seed(0)
    rows = []
    t_start = time.time()
    for fmt in args.formats:
        work = workloads(fmt, g)
        for path in paths:
            pid, R = qgemv.PATHS.index(path), qgemv.TILE_ROWS[path]
            # each side's tiles by its own repack, made in pass order (a model's are: BlockLinear repacks
            # at its first call), so where repack places them is part of what is compared
            tiles = {side: {s: [(op.repack(m, qgemv.FMT[fmt], R), n) for m, n in work[s]] for s in work}
                     for side, op in ops.items()}
            for threads in args.threads:
                torch.set_num_threads(threads)
                for M in args.rows:
                    x = torch.randn(M, 1536, generator=g)
                    for shape in args.shapes:
                        mats = tiles["new"][shape]
                        nbytes = sum(m.nbytes for m, _ in work[shape])
                        times = {side: [] for side in ops}
                        for _ in range(args.rounds):
                            for side, op in ops.items():
                                ts = tiles[side][shape]
                                times[side].append(op.tile_passes([t for t, _ in ts], [qgemv.FMT[fmt]] * len(ts),
                                                                  [n for _, n in ts], x, pid, args.reps))
                        row = dict(fmt=fmt, path=path, threads=threads, M=M, shape=shape, bytes=nbytes, mats=len(mats))
                        for side in ops:
                            sec = statistics.median(times[side])
                            row[f"{side}_us"] = sec * 1e6
                            row[f"{side}_gbs"] = nbytes / sec / 1e9
                        if "ref" in ops:
                            row["x_ref"] = statistics.median(r / n for r, n in zip(times["ref"], times["new"]))
                        rows.append(row)
                        print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                              file=sys.stderr, flush=True)
        del work, tiles
    run.finish()
    ref = f" against `{args.against}`" if args.against else ""
    lines = [f"# The tile kernels in isolation at SmolLM2-135M's shapes{ref}\n",
             f"{args.rounds} alternated rounds of {args.reps} passes; GB/s = weight bytes (blocks incl. scales) per "
             "pass / median pass time; `x ref` = median per-round ratio of the reference's time to this tree's "
             "(> 1: faster). `step` = 30 layers x (qkv, o, gate, up, down) in decode order; the shapes 30 copies "
             f"each; `head` one 49152x576; `o-l2` one 576x576 (in L2). Took {time.time() - t_start:.0f} s.\n",
             "| format | path | threads | M | shape | MB | µs | GB/s |" + (" ref µs | ref GB/s | x ref |" if ref else ""),
             "|---|---|---:|---:|---|---:|---:|---:|" + ("---:|---:|---:|" if ref else "")]
    for r in rows:
        line = (f"| {r['fmt']} | {r['path']} | {r['threads']} | {r['M']} | {r['shape']} | {r['bytes'] / 1e6:.1f} | "
                f"{r['new_us']:.0f} | {r['new_gbs']:.1f} |")
        if ref:
            line += f" {r['ref_us']:.0f} | {r['ref_gbs']:.1f} | {r['x_ref']:.2f} |"
        lines.append(line)
    text = "\n".join(lines) + "\n"
    run.write_result("quant", "tile_kernels", args.tag, text, dict(rows=rows, against=args.against))
    print(text)


if __name__ == "__main__":
    main()
