"""What the hook points cost when no hook is set: main (before the hooks existed) against this
checkout with hooks off, the same workloads alternated in one run (medians and ratios).

    git archive 032c887 | tar -x -C /tmp/interp-main         # main before the hooks
    python benchmarks/interp/hooks_cost.py --a /tmp/interp-main --rounds 5

Each round runs every workload once on each side (the order flips every round), each in a fresh
subprocess with that side's ``src`` first on the path. The hooks add one ``step.hooks is not None``
test per block and per attention layer, and one per forward in the embedding and the final norm.
Criterion, fixed before the run: "costs nothing measurable" means every B/A ratio of medians lies
inside the per-round ratios' min..max spread (the run-to-run noise), or within 0.97..1.03. A run
whose per-round ratios spread wider than 0.8..1.2 judges nothing (other work disturbed it) and says so.

Writes benchmarks/results/interp/hooks_cost.md (``--out`` elsewhere).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

COMMON = """
import json, time, torch
from tformer import DecoderLM, TransformerConfig
from tformer.generation.generate import generate
torch.manual_seed(0)
def report(v): print(json.dumps({"value": v}))
"""
WORKLOADS = {
    "decode tiny (4L/128, 200 tokens, greedy): tok/s": """
m = DecoderLM(TransformerConfig.from_name("tiny")).eval(); ids = torch.randint(0, 256, (1, 8))
generate(m, ids, 20, temperature=0)
t = time.perf_counter(); generate(m, ids, 200, temperature=0); report(200 / (time.perf_counter() - t))
""",
    "decode Llama-shaped 8L/512 GQA (prompt 32, 64 new): tok/s": """
m = DecoderLM(TransformerConfig.from_name("llama-style")).eval(); ids = torch.randint(0, 32000, (1, 32))
generate(m, ids, 4, temperature=0)
t0 = time.perf_counter(); generate(m, ids, 1, temperature=0); prefill = time.perf_counter() - t0
t = time.perf_counter(); generate(m, ids, 65, temperature=0); report(64 / (time.perf_counter() - t - prefill))
""",
    "train tiny (4L/128, ctx 64, batch 12): steps/s": """
m = DecoderLM(TransformerConfig.from_name("tiny")); opt = torch.optim.AdamW(m.parameters(), 1e-3)
x = torch.randint(0, 256, (12, 64)); y = torch.randint(0, 256, (12, 64))
def step():
    _, loss = m(x, targets=y); opt.zero_grad(set_to_none=True); loss.backward(); opt.step()
for _ in range(5): step()
t = time.perf_counter(); n = 40
for _ in range(n): step()
report(n / (time.perf_counter() - t))
""",
}


def main() -> None:
    root = Path(__file__).resolve().parents[2]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", type=Path, required=True, help="main before the hooks (e.g. git archive 032c887)")
    ap.add_argument("--b", type=Path, default=root, help="this checkout (default: the repository)")
    ap.add_argument("--a-name", default="main 032c887", help="how the table names side A")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/interp/hooks_cost.md")
    args = ap.parse_args()
    sys.path.insert(0, str(root / "benchmarks"))
    from common.ab import alternate, ratio_stats
    from common.record import Run, commit, results_dir

    record = Run()
    values = alternate({n: COMMON + code for n, code in WORKLOADS.items()}, args.a, args.b, args.rounds, args.threads,
                       timeout=900)
    record.finish()
    lines = [f"# Hook points, hooks off: this branch (B, {commit()[:7]}) against {args.a_name} (A)", "",
             f"{args.threads} threads, {args.rounds} alternated rounds, a fresh process per measurement.", "",
             "| workload (higher is better) | A median | B median | B/A | per-round B/A min..max | inside the noise |",
             "|---|---:|---:|---:|---|---|"]
    for n in WORKLOADS:
        a, b = values[n]["A"], values[n]["B"]
        ratio, lo, hi = ratio_stats(a, b)
        ok = lo <= ratio <= hi or 0.97 <= ratio <= 1.03
        verdict = "no verdict: too noisy" if lo < 0.8 or hi > 1.2 else "yes" if ok else "NO"
        lines.append(f"| {n} | {statistics.median(a):.2f} | {statistics.median(b):.2f} | {ratio:.3f} | "
                     f"{lo:.2f}..{hi:.2f} | {verdict} |")
    lines += ["", "Per-round values (A; B):", ""]
    lines += [f"- {n}: {', '.join(f'{v:.2f}' for v in values[n]['A'])}; "
              f"{', '.join(f'{v:.2f}' for v in values[n]['B'])}" for n in WORKLOADS]
    text = "\n".join(lines) + "\n"
    print(text)
    record.write(args.out or results_dir("interp") / "hooks_cost.md", text)


if __name__ == "__main__":
    main()
