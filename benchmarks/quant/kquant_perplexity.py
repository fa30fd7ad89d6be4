"""Real weights in K-quants: SmolLM2-135M-Instruct's GGUF (the built-in Q4_1 file) re-quantised to Q4_K_M by
llama.cpp's own quantiser (``allow_requantize``), then tformer (``open_model`` at ``--dtype auto``: each
matrix in its file format) against llama.cpp on that file.

- perplexity on the last 10% of tinyshakespeare (by characters), windows of 512 tokens every 256 (each
  token scored once, with 256 to 511 tokens of context), the same windows and ids for both;
  goal (issue 47): tformer's within 0.5% of llama.cpp's;
- greedy agreement over 32 tokens with the float32 import of the same file (``load_gguf``: every tensor
  dequantised by ``gguf.quants``), from the first 64 tokens of that text.

SmolLM2's width (576) is no multiple of 256, so the quantiser stores most matrices in its fallbacks
(Q5_0; the embedding Q8_0) and ``ffn_down`` (1536 inputs) in Q4_K / Q6_K: the file says which.

    flock /tmp/tformer-bench.lock env PYTHONPATH=src:/work/llama_native \\
        .venv/bin/python benchmarks/quant/kquant_perplexity.py --out /tmp/smollm2-q4_k_m.gguf

Writes benchmarks/results/quant/kquant_perplexity.md and .json.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests" / "quant"))
from common.record import Run, results_dir  # noqa: E402
from interop.smollm2_parity import nll, windows  # noqa: E402  (the same windows and scoring)

TEXTS = [ROOT.parent / "shared" / "data" / "tinyshakespeare.txt", Path("/work/shared/data/tinyshakespeare.txt")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/smollm2-q4_k_m.gguf"), help="the re-quantised file")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    import kquant_files

    from tformer.inference import open_model
    from tformer.interop.builtin import builtin_path
    from tformer.interop.gguf_import import load_gguf
    from tformer.interop.gguf_reader import GGUFFile
    from tformer.interop.llama_cpp import LlamaCpp

    run = Run()
    torch.set_num_threads(args.threads)
    if not args.out.is_file():
        kquant_files.quantize(builtin_path("smollm2"), args.out, "q4_k_m", requantize=True)
    types = Counter(t.type for t in GGUFFile(args.out).tensors.values() if len(t.shape) == 2)
    opened = open_model(args.out, threads=args.threads)
    text = next(t for t in TEXTS if t.is_file()).read_text(encoding="utf-8")
    ids = opened.tokenizer.encode(text[len(text) * 9 // 10:])
    lc = LlamaCpp(args.out, n_ctx=512, threads=args.threads, logits_all=True, f32_cache=True)
    sums = {"tformer": 0.0, "llama.cpp": 0.0}
    scored, start = 0, time.perf_counter()
    for begin, end, first in windows(len(ids)):
        window = ids[begin:end]
        with torch.inference_mode():
            ours = opened.model(torch.tensor([window]))[0][0].float().numpy()
        sums["tformer"] += nll(ours, ids, begin, first, end)
        sums["llama.cpp"] += nll(lc.logits(window), ids, begin, first, end)
        scored += end - first
    ppl = {k: math.exp(v / scored) for k, v in sums.items()}
    rel = (ppl["tformer"] - ppl["llama.cpp"]) / ppl["llama.cpp"]
    # greedy agreement with the float32 import over 32 tokens after the text's first 64 tokens
    prompt = torch.tensor([ids[:64]])
    from tformer.generation.generate import generate

    floats = load_gguf(args.out)
    a = generate(opened.model, prompt, max_new_tokens=32, temperature=0)[0, 64:].tolist()
    b = generate(floats, prompt, max_new_tokens=32, temperature=0)[0, 64:].tolist()
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    lines = ["# SmolLM2-135M-Instruct re-quantised to Q4_K_M by llama.cpp: tformer vs llama.cpp", "",
             f"File: the built-in Q4_1 GGUF through `llama_model_quantize` (Q4_K_M, allow_requantize): matrices "
             f"{dict(types)}; tformer opened it as `{opened.dtype}` ({opened.path} path).", "",
             f"Perplexity on the last 10% of tinyshakespeare ({scored:,} scored tokens, windows of 512 every 256, "
             f"{args.threads} thread(s), {time.perf_counter() - start:.0f} s): tformer {ppl['tformer']:.4f}, llama.cpp "
             f"{ppl['llama.cpp']:.4f}, difference {100 * rel:+.3f}% (goal: within 0.5%).", "",
             f"Greedy, 32 tokens after the text's first 64 tokens: equal to the float32 import's for the first {same} "
             f"of 32 ({sum(x == y for x, y in zip(a, b))} positions equal in all)."]
    out = results_dir("quant") / "kquant_perplexity"
    run.write(out.with_suffix(".md"), "\n".join(lines) + "\n")
    run.write_json(out.with_suffix(".json"), {"ppl": ppl, "relative": rel, "scored": scored, "types": dict(types),
                                              "greedy": {"blocks": a, "float32": b, "first_equal": same}})
    print("\n".join(lines))


if __name__ == "__main__":
    main()
