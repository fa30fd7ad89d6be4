"""Speculative decoding with prompt-lookup drafts on SmolLM2-135M-Instruct, one stream, greedy:
`tformer.generation.speculative.generate_speculative` against plain `tformer.generate`, same prompt,
same new tokens, alternating, medians.

Six chat prompts (the model's chat template): three where the answer copies the prompt (rewrite,
code edit, repeat-with-a-change: where prompt lookup drafts well), a summary, and two open questions
(where it drafts little). Per prompt: whether the tokens are identical (they must be), tokens/s of
each, the speed-up, the acceptance rate and tokens per verification forward.

In bf16 a forward over k+1 tokens rounds differently from a one-token step, so a near-tie can flip
the greedy token (the table says where); fp32 (``--dtype fp32 --name speculative-fp32``) is exact.
``--dtype q4_1`` serves the GGUF's own Q4_1 blocks (``open_model``, what ``tformer serve --dtype q4_1``
loads): integer block products per row with each row's activations quantised on their own, and the
rest in fp32, so a k+1-row forward should give each row what a one-row step gives (the table checks it).

Criterion (the issue's, set before the run): >= 1.5x single-stream greedy decode speed with identical
tokens on at least 5 prompts.

    flock -w 900 /tmp/tformer-bench.lock timeout 300 env PYTHONPATH=src python benchmarks/serving/speculative.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.record import Run, results_dir  # noqa: E402

CODE = ("def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n\n"
        "def variance(values):\n    m = mean(values)\n    total = 0\n    for v in values:\n        total += (v - m) ** 2\n"
        "    return total / len(values)\n")
TEXT = ("The library opens at nine in the morning and closes at six in the evening. Children can borrow up to five "
        "books at a time, and adults can borrow up to ten. Books must be returned within three weeks. The reading "
        "room on the first floor is quiet, and the café on the ground floor sells coffee and sandwiches.")
PROMPTS = {
    "code-edit": f"Rename the function `mean` to `average` everywhere in this code and show the full code:\n\n{CODE}",
    "rewrite": f"Rewrite this text, replacing 'library' with 'museum'. Keep everything else the same:\n\n{TEXT}",
    "repeat": f"Copy this text exactly, then add one sentence at the end:\n\n{TEXT}",
    "summarise": f"Summarise this text in two sentences:\n\n{TEXT}",
    "explain-code": f"Explain what this code does, line by line:\n\n{CODE}",
    "open": "Write a short story about a robot who learns to paint.",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=6, help="drafted tokens per step")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="bf16", help="default: what serve_precision.py chose for serving here")
    ap.add_argument("--prompts", default=",".join(PROMPTS))
    ap.add_argument("--draft", default=None, help="a draft model instead of prompt lookup: the same model at this "
                    "precision (e.g. q4_1: the file's own blocks), drafting for --dtype")
    ap.add_argument("--name", default="speculative", help="results file stem (default: speculative)")
    args = ap.parse_args()
    run = Run()
    from tformer import generate
    from tformer.generation.speculative import generate_speculative
    from tformer.inference import open_model

    opened = open_model("smollm2", args.dtype)                    # the file's blocks where it stores that format
    model = opened.model
    draft = open_model("smollm2", args.draft).model if args.draft else None
    tok, template = opened.tokenizer, opened.template
    rows = []
    for name in args.prompts.split(","):
        ids = torch.tensor([template.encode(tok, [{"role": "user", "content": PROMPTS[name]}])])
        n = args.new_tokens
        runs = {"plain": lambda: generate(model, ids, n, temperature=0)[0, ids.shape[1]:].tolist(),
                "speculative": lambda: generate_speculative(model, ids, n, k=args.k, draft_model=draft)}
        times, out = {"plain": [], "speculative": []}, {}
        for r in range(args.rounds):
            for which in (list(runs) if r % 2 == 0 else list(reversed(runs))):
                t = time.perf_counter()
                out[which] = runs[which]()
                times[which].append(time.perf_counter() - t)
        spec, stats = out["speculative"]
        same = spec == out["plain"][:len(spec)] and len(spec) == len(out["plain"])
        tp, ts = (len(spec) / statistics.median(times[w]) for w in ("plain", "speculative"))
        rows.append((name, ids.shape[1], len(spec), same, tp, ts, ts / tp, stats.acceptance, (len(spec) - 1) / max(1, stats.forwards)))
        print(rows[-1], flush=True)
        write(run, args, rows, done=len(rows) == len(args.prompts.split(",")))   # a partial table survives a timeout


def write(run, args, rows, done: bool) -> None:
    lines = ["# Speculative decoding (prompt lookup) on SmolLM2-135M-Instruct, one stream, greedy", "",
             f"{args.dtype}" + (f", drafted by the same model at {args.draft}" if args.draft else ", prompt-lookup drafts") + f", k = {args.k} drafted tokens per verification forward, {args.new_tokens} new tokens, "
             f"{args.rounds} rounds alternating plain and speculative; medians." + ("" if done else " (Partial: run interrupted.)"), "",
             "| prompt | prompt tokens | new tokens | identical tokens | plain tok/s | speculative tok/s | speed-up | "
             "acceptance | tokens per decode forward |", "|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for name, p, n, same, tp, ts, x, acc, per in rows:
        lines.append(f"| {name} | {p} | {n} | {same} | {tp:.1f} | {ts:.1f} | {x:.2f}x | {acc:.2f} | {per:.2f} |")
    good = [r for r in rows if r[3] and r[6] >= 1.5]
    lines += ["", f"Identical tokens on {sum(r[3] for r in rows)} of {len(rows)} prompts; >= 1.5x with identical "
                  f"tokens on {len(good)} ({', '.join(r[0] for r in good) or 'none'}). Median speed-up over all prompts "
                  f"{statistics.median(r[6] for r in rows):.2f}x."]
    if done:
        run.finish()
    text = run.write(results_dir("serving") / f"{args.name}.md", "\n".join(lines)).read_text()
    if done:
        print(text)

if __name__ == "__main__":
    main()
