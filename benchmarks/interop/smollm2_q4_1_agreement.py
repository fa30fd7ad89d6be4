"""SmolLM2-135M-Instruct: greedy answers of the Q4_1 blocks against the float32 import, over several chat prompts.

The inference table's "greedy = fp32 (of 32)" column (docs/inference.md) said 100% for q4_1 on one prompt.
This runs both as a user gets them, ``tformer.inference.open_model("smollm2", "q4_1")`` (the GGUF's own Q4_1
blocks, activations rounded to 8-bit blocks in the kernels) and ``open_model("smollm2", "fp32")`` (the same
weights dequantised to float32), on each chat prompt below (rendered by the model's chat template), 32 greedy
tokens each (``generate_tokens``, temperature 0, stopping at the end of the turn as chat does), and reports per
prompt whether the answers agree and, where they split, the step and the margins there:

    fp32 margin   the float32 model's logit for its own pick minus its logit for the Q4_1 model's pick
    q4_1 margin   the Q4_1 model's logit for its own pick minus its logit for the float32 model's pick

each from that model's own decode path (the prompt prefilled, then one token a step, as ``generate_tokens``
runs it; the argmax there is checked against the generated token). Two small margins are a near-tie that
rounding decides; a large one would be a defect.

Results: benchmarks/results/interop/smollm2_q4_1_agreement.{md,json}, with the run's record (common/record.py).

    export PYTHONPATH=$PWD/src
    flock -w 900 /tmp/tformer-bench.lock timeout 600 .venv/bin/python benchmarks/interop/smollm2_q4_1_agreement.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # benchmarks/, for common/
from common.record import Run, results_dir  # noqa: E402

OUT = results_dir("interop") / "smollm2_q4_1_agreement"
# The five of smollm2_parity.py and the one prompt of the earlier figure, then new ones: 10 chat prompts.
PROMPTS = ["Write a short poem about the sea.", "What is the capital of France?",
           "Explain photosynthesis in one sentence.", "Give me three tips for learning to program.",
           "What is 12 times 7?", "What is the capital of France? Answer in one word.",
           "Describe a cat to someone who has never seen one.", "Why is the sky blue?",
           "Write a haiku about autumn leaves.", "List the planets of the solar system in order."]
TOKENS = 32


def greedy(opened, ids: list[int]) -> list[int]:
    """The answer as chat generates it: ``generate_tokens`` at temperature 0, to the end of the turn."""
    from tformer.generation.generate import generate_tokens

    stop = set(opened.stop_ids)
    out = []
    for tok in generate_tokens(opened.model, torch.tensor([ids]), TOKENS, temperature=0.0,
                               stop_tokens=list(stop) or None):
        t = int(tok[0])
        out.append(t)
        if t in stop:
            break
    return out


def stepped(opened, ids: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """The decode path's logits before each of ``tokens`` (the prompt prefilled, then one token a step, as
    ``generate_tokens`` runs them): what the greedy pick was made from, so the margins are the decode's own."""
    from tformer.generation.generate import GenerationOptions, _Stepper

    stepper = _Stepper(opened.model, torch.tensor([ids]), None, TOKENS, GenerationOptions.of(None, temperature=0.0))
    logits, out = stepper.first(), []
    for t in tokens:
        out.append(logits[0].float().clone())
        logits = stepper.next(torch.tensor([t]))
    return out


def compare(fp32, q41, prompt: str) -> dict:
    ids = fp32.template.encode(fp32.tokenizer, [{"role": "user", "content": prompt}])
    a, b = greedy(fp32, ids), greedy(q41, ids)
    row = {"prompt": prompt, "prompt_tokens": len(ids), "fp32": a, "q4_1": b,
           "fp32_text": fp32.tokenizer.decode(a), "q4_1_text": q41.tokenizer.decode(b)}
    k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if k is None and len(a) != len(b):
        k = min(len(a), len(b))                  # one stopped, the other went on: a split at that step
    row["agree"] = k is None
    row["common"] = len(a) if k is None else k
    if k is None:
        return row
    la, lb = stepped(fp32, ids, a[:k + 1])[k], stepped(q41, ids, b[:k + 1])[k]    # same prefix: a[:k] == b[:k]
    pa = a[k] if k < len(a) else int(la.argmax())
    pb = b[k] if k < len(b) else int(lb.argmax())
    row["split"] = {"step": k, "fp32_pick": pa, "q4_1_pick": pb,
                    "fp32_pick_text": fp32.tokenizer.decode([pa]), "q4_1_pick_text": q41.tokenizer.decode([pb]),
                    "fp32_margin": float(la[pa] - la[pb]), "q4_1_margin": float(lb[pb] - lb[pa]),
                    "steps_agree_with_generate": int(la.argmax()) == pa and int(lb.argmax()) == pb}
    return row


def report(rows: list[dict], run: Run, threads: int) -> str:
    agree = sum(r["agree"] for r in rows)
    splits = [r["split"] for r in rows if not r["agree"]]
    lines = ["# SmolLM2-135M-Instruct: Q4_1 blocks against the float32 import, greedy, several chat prompts", "",
             f"`open_model(\"smollm2\", \"q4_1\")` against `open_model(\"smollm2\", \"fp32\")`, {TOKENS} greedy tokens "
             f"per prompt (to the end of the turn if sooner), {len(rows)} chat prompts, {threads} thread(s).", "",
             f"**Agreement: {agree} of {len(rows)} prompts** give the same answer token for token."
             + (f" Where they split, the margins are {min(s['fp32_margin'] for s in splits):.3f}-"
                f"{max(s['fp32_margin'] for s in splits):.3f} (float32) and {min(s['q4_1_margin'] for s in splits):.3f}-"
                f"{max(s['q4_1_margin'] for s in splits):.3f} (Q4_1) logits: near-ties that rounding decides."
                if splits else ""), "",
             "| prompt | tokens | same tokens | split at | fp32 picks | q4_1 picks | fp32 margin | q4_1 margin |",
             "|---|---:|---:|---:|---|---|---:|---:|"]
    for r in rows:
        s = r.get("split")
        if s is None:
            lines.append(f"| {r['prompt']} | {len(r['fp32'])} | {r['common']} (all) | - | - | - | - | - |")
        else:
            note = "" if s["steps_agree_with_generate"] else " (the stepped pick differs from generate's)"
            lines.append(f"| {r['prompt']} | {len(r['fp32'])} / {len(r['q4_1'])} | {r['common']} | {s['step']} | "
                         f"{s['fp32_pick_text']!r} | {s['q4_1_pick_text']!r} | {s['fp32_margin']:.3f} | "
                         f"{s['q4_1_margin']:.3f}{note} |")
    lines += ["", "Margins: at the step where the answers split, each model's logit for its own pick minus its logit "
              "for the other model's pick, from its own decode (the prompt prefilled, then one token a step, as "
              "`generate_tokens` runs it).", "", "## The answers", ""]
    for r in rows:
        lines += [f"**{r['prompt']}**", "", f"- fp32: {r['fp32_text']!r}", f"- q4_1: {r['q4_1_text']!r}", ""]
    return "\n".join(lines)


def main() -> int:
    from tformer.inference import open_model

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    run = Run()
    fp32 = open_model("smollm2", "fp32", args.threads)
    q41 = open_model("smollm2", "q4_1", args.threads)
    rows = []
    for prompt in PROMPTS:
        rows.append(compare(fp32, q41, prompt))
        r = rows[-1]
        print(f"{prompt[:40]:<40} agree={r['agree']} common={r['common']}"
              + (f" margins {r['split']['fp32_margin']:.3f} / {r['split']['q4_1_margin']:.3f}" if "split" in r else ""),
              flush=True)
    run.finish()
    run.write_json(OUT.with_suffix(".json"), {"tokens": TOKENS, "threads": args.threads, "rows": rows,
                                              "agree": sum(r["agree"] for r in rows), "prompts": len(rows)})
    run.write(OUT.with_suffix(".md"), report(rows, run, args.threads))
    print(f"wrote {OUT.with_suffix('.md')} and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
