"""Where a SmolLM2-135M decode step's time goes on the whole-layer route (:mod:`tformer.fused`): the
whole step, its 30 layers in one ``tformer_fused::layers`` call, the final norm + LM head, its
products where they run, and the same products alone on the model's own tiles.

The GGUF's own Q4_1 file (Q8_0 token table, tied head), ``load_gguf(keep_quant=True)``, a 128-token
random prompt, then per part the median of ``--steps`` timed calls at positions ~136-216 (the
positions of smollm2_llama_cpp.py's decode). ``where they run``: the time inside ``tile_product``
during the step (``tformer_fused::product_ns`` for the layers' and ``tformer_qgemv::product_ns`` for
the head's, each its own clock), among the layer's other work;
``products alone``: ``tformer_qgemv::tile_passes``
over the plan's 150 tile matrices in decode order (no attention, norms, Python), and over the head's
tiles; ``short cache``: the whole step at positions 8-32, so the difference to the first row is what
attention over ~176 keys adds. Parts are timed separately, so they need not sum to the step.

    flock -w 900 /tmp/tformer-bench.lock timeout 300 env PYTHONPATH=$PWD/src \\
        .venv/bin/python benchmarks/quant/smollm2_step_profile.py --threads 1

Writes benchmarks/results/quant/smollm2_step_profile[-TAG].md and .json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from tformer.generation.step import decode_step, prefill
from tformer.interop.builtin import builtin_path
from tformer.interop.gguf_import import load_gguf
import tformer.fused as whole
from tformer.quant import qgemv

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # benchmarks/, for common/
from common.record import Run  # noqa: E402


@torch.inference_mode()
def profile(model, steps: int) -> dict[str, float]:
    """part -> median seconds."""
    ids = torch.randint(0, 49152, (1, 128), generator=torch.Generator().manual_seed(0))
    state = model.new_state(1, 128 + 3 * steps + 16)
    tok = prefill(model, ids, state).argmax(-1, keepdim=True)
    for _ in range(8):
        tok = decode_step(model, tok, state).argmax(-1, keepdim=True)
    choice = whole.chosen(model)
    p = choice.plan
    if p is None:
        sys.exit(f"smollm2_step_profile: no whole-layer plan ({choice.reason})")
    t = {"step": [], "layers": [], "head": [], "products_in_step": []}
    for _ in range(steps):
        torch.ops.tformer_fused.product_ns(True)
        torch.ops.tformer_qgemv.product_ns(True)
        t0 = time.perf_counter()
        tok = decode_step(model, tok, state).argmax(-1, keepdim=True)
        t["step"].append(time.perf_counter() - t0)
        ns = torch.ops.tformer_fused.product_ns(True) + torch.ops.tformer_qgemv.product_ns(True)   # layers + head
        t["products_in_step"].append(ns * 1e-9)
    t["layers"], t["head"] = layers_then_head(model, p, tok, state, steps)
    out = {k: statistics.median(v) for k, v in t.items()}
    mats, fmts, ns = [], [], []
    widths = p.dims[0] * p.dims[2] + 2 * p.dims[1] * p.dims[2], model.config.d_model, p.dims[3], p.dims[3], \
        model.config.d_model
    for _, tiles, _, fm in p.layers:          # (norms, matrices, biases, formats)
        mats += tiles
        fmts += fm
        ns += list(widths)
    x = torch.randn(1, max(model.config.d_model, p.dims[3]))
    out["products"] = statistics.median(op_passes(mats, fmts, ns, x, p.path_id) for _ in range(5))
    head = model.lm_head
    out["head_product"] = statistics.median(
        op_passes([head._tiled[p.path]], [qgemv.FMT[head.fmt]], [head.out_features], x, p.path_id) for _ in range(5))
    out["bytes_layers"] = sum(m.nbytes for m in mats)
    out["bytes_head"] = head._tiled[p.path].nbytes
    short = model.new_state(1, 64)
    prefill(model, ids[:, :8], short)
    s = []
    for _ in range(24):
        t0 = time.perf_counter()
        decode_step(model, tok, short)
        s.append(time.perf_counter() - t0)
    out["step_short_cache"] = statistics.median(s)
    return out


def layers_then_head(model, p, tok, state, steps: int) -> tuple[list[float], list[float]]:
    """Seconds of ``steps`` calls of the layers by hand (as tformer.fused.decode calls them) and, after each,
    of the final norm + LM head; the state advances a token per step."""
    layers, head = [], []
    for _ in range(steps):
        pos = torch.full((1,), state.length, dtype=torch.long)
        x = model.tok_emb(tok).reshape(1, -1).float().contiguous()
        t0 = time.perf_counter()
        whole.run_layers(p, x, [(s.k, s.v) for s in state.layers], pos, pos, None, None)
        t1 = time.perf_counter()
        model.lm_head(model.final_norm(x[:, None]))
        head.append(time.perf_counter() - t1)
        layers.append(t1 - t0)
        state.valid[:, state.length] = True
        state.advance(state.length + 1)
    return layers, head


def op_passes(mats, fmts, ns, x, path_id) -> float:
    return torch.ops.tformer_qgemv.tile_passes(mats, fmts, ns, x, path_id, 10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    run = Run()
    torch.set_num_threads(args.threads)
    model = load_gguf(builtin_path("smollm2"), keep_quant=True)
    r = profile(model, args.steps)
    ms = lambda k: f"{r[k] * 1e3:.2f}"  # noqa: E731
    gbs = lambda b, k: f"{r[b] / r[k] / 1e9:.1f}"  # noqa: E731
    lines = [f"# A SmolLM2-135M Q4_1 decode step on the whole-layer route, part by part ({args.threads} thread(s), path {qgemv.path()})", "",
             f"Median of {args.steps} steps at positions ~136-{136 + 2 * args.steps}; parts timed separately.", "",
             "| part | ms | GB/s of weights |", "|---|---:|---:|",
             f"| whole step (`decode_step` + argmax) | {ms('step')} | |",
             f"| its 151 products where they run (`tile_product`'s own clock: layers + head) | {ms('products_in_step')} | "
             f"{(r['bytes_layers'] + r['bytes_head']) / r['products_in_step'] / 1e9:.1f} |",
             f"| the 30 layers (`tformer_fused::layers`) | {ms('layers')} | {gbs('bytes_layers', 'layers')} |",
             f"| final norm + LM head (`BlockLinear`, {model.lm_head.fmt}) | {ms('head')} | {gbs('bytes_head', 'head')} |",
             f"| the layers' 150 products alone (`tile_passes`, the plan's tiles) | {ms('products')} | "
             f"{gbs('bytes_layers', 'products')} |",
             f"| the head's product alone | {ms('head_product')} | {gbs('bytes_head', 'head_product')} |",
             f"| whole step at positions 8-32 (short cache) | {ms('step_short_cache')} | |"]
    text = "\n".join(lines) + "\n"
    print(text)
    run.finish()
    run.write_result("quant", "smollm2_step_profile", args.tag, text, {"threads": args.threads, "seconds": r})


if __name__ == "__main__":
    main()
