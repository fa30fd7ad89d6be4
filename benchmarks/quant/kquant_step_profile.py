"""Where a decode step on a K-quant GGUF file goes (``open_model`` at ``--dtype auto``, the whole-layer route):
the step, its layers in one ``tformer_fused::layers`` call, the head, the products' own clocks in the step,
and each format's products alone.

A 64-token random prompt, then per part the median of ``--steps`` timed calls. ``products in the step``:
the time inside the product loops during the step (``tformer_fused::product_ns`` for the layers',
``tformer_qgemv::product_ns`` for the head's). ``alone``: per storage format, one pass over the model's
matrices of that format in decode order with one activation row (``qgemv.kqgemm`` for the formats read in
the file layout, ``qgemv.qgemm`` on the model's tiles for q8_0 / q4_0 / q4_1), from Python (a call costs
~10 us of dispatch), GB/s of the bytes the kernels read. llama.cpp's whole-token figure for comparison:
the file's tensor bytes times its decode tok/s (benchmarks/results/quant/kquant_llama_cpp*.md).

    flock /tmp/tformer-bench.lock env PYTHONPATH=src .venv/bin/python benchmarks/quant/kquant_step_profile.py \\
        --file /tmp/kq/qwen05-q4_k_m.gguf --threads 1

Writes benchmarks/results/quant/kquant_step_profile[-TAG].md and .json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # benchmarks/, for common/
from common.measure import read_bandwidth  # noqa: E402
from common.record import Run  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--file", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    import tformer.fused as whole
    from tformer.generation.step import decode_step, prefill
    from tformer.inference import open_model
    from tformer.quant import qgemv
    from tformer.quant.block_linear import BlockLinear, StackedLinear
    from quant.smollm2_step_profile import layers_then_head

    run = Run()
    opened = open_model(args.file, threads=args.threads)
    model = opened.model
    p = whole.chosen(model).plan
    if p is None:
        sys.exit(f"kquant_step_profile: no whole-layer plan ({whole.chosen(model).reason})")
    ids = torch.randint(100, 30000, (1, 64), generator=torch.Generator().manual_seed(0))
    state = model.new_state(1, 64 + 3 * args.steps + 16)
    t: dict[str, list] = {"step": [], "products_in_step": [], "layers": [], "head": []}
    with torch.inference_mode():
        tok = prefill(model, ids, state).argmax(-1, keepdim=True)
        for _ in range(4):
            tok = decode_step(model, tok, state).argmax(-1, keepdim=True)
        for _ in range(args.steps):
            torch.ops.tformer_fused.product_ns(True)
            torch.ops.tformer_qgemv.product_ns(True)
            t0 = time.perf_counter()
            tok = decode_step(model, tok, state).argmax(-1, keepdim=True)
            t["step"].append(time.perf_counter() - t0)
            t["products_in_step"].append((torch.ops.tformer_fused.product_ns(True) + torch.ops.tformer_qgemv.product_ns(True)) * 1e-9)
        t["layers"], t["head"] = layers_then_head(model, p, tok, state, args.steps)
        # each format's products alone, in decode order
        by_fmt: dict[str, list] = defaultdict(list)
        for b in model.blocks:
            for lin in (b.attn.qkv_proj, b.attn.out_proj, b.ffn.gate, b.ffn.up, b.ffn.down):
                for part in (lin.parts if isinstance(lin, StackedLinear) else [lin]):
                    if isinstance(part, BlockLinear):
                        by_fmt[part.fmt].append(part)
        alone = {}
        for fmt, lins in by_fmt.items():
            xs = {lin.in_features: torch.randn(1, lin.in_features) for lin in lins}
            for lin in lins:
                lin.product(xs[lin.in_features])                       # tiles made, caches warm once
            passes = []
            for _ in range(5):
                t0 = time.perf_counter()
                for lin in lins:
                    lin.product(xs[lin.in_features])
                passes.append(time.perf_counter() - t0)
            read = sum((lin.blocks.nbytes for lin in lins))
            alone[fmt] = {"seconds": statistics.median(passes), "bytes": read, "matrices": len(lins)}
    r = {k: statistics.median(v) for k, v in t.items()}
    head = model.lm_head
    bytes_layers = sum(a["bytes"] for a in alone.values())
    lines = [f"# A decode step on {args.file.name} ({opened.dtype}), whole-layer route, part by part "
             f"({args.threads} thread(s), path {qgemv.path()})", "",
             f"Median of {args.steps} steps after a 64-token prompt; parts timed separately.", "",
             "| part | ms | GB/s of weights read |", "|---|---:|---:|",
             f"| whole step (`decode_step` + argmax) | {r['step'] * 1e3:.2f} | "
             f"{(bytes_layers + head.blocks.nbytes) / r['step'] / 1e9:.1f} |",
             f"| its products where they run (layers + head, the loops' own clocks) | {r['products_in_step'] * 1e3:.2f} | "
             f"{(bytes_layers + head.blocks.nbytes) / r['products_in_step'] / 1e9:.1f} |",
             f"| the layers (`tformer_fused::layers`) | {r['layers'] * 1e3:.2f} | {bytes_layers / r['layers'] / 1e9:.1f} |",
             f"| final norm + LM head ({head.fmt}, {head.blocks.nbytes / 2**20:.0f} MiB) | {r['head'] * 1e3:.2f} | "
             f"{head.blocks.nbytes / r['head'] / 1e9:.1f} |"]
    lines.append(f"| the machine's read bandwidth (`x.sum()` over 512 MB, best of 9; common/measure.py) | – | "
                 f"{read_bandwidth():.1f} |")
    for fmt, a in sorted(alone.items()):
        lines.append(f"| the layers' {a['matrices']} {fmt} products alone ({a['bytes'] / 2**20:.0f} MiB) | "
                     f"{a['seconds'] * 1e3:.2f} | {a['bytes'] / a['seconds'] / 1e9:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    run.finish()
    run.write_result("quant", "kquant_step_profile", args.tag, text,
                     {"threads": args.threads, "seconds": r, "alone": alone, "file": str(args.file)})


if __name__ == "__main__":
    main()
