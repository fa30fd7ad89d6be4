"""A/B: the same workloads on two checkouts of tformer, alternated in one run (medians and ratios).

Used to check that a refactor made nothing slower: each round runs every workload once on each
checkout (the order flips every round), in a fresh subprocess with that checkout's ``src`` first
on the path, so both see the same machine at nearly the same moment.

    git worktree add /tmp/prev-main <old commit>
    python benchmarks/ab/ab_compare.py --a /tmp/prev-main --b . --rounds 5 [--compiled]

Writes benchmarks/results/ab/ab_compare.md (``--out`` elsewhere); the title names each side by its commit,
not by its folder.

Each workload prints one number (higher is better); the table gives each side's median, the
ratio of medians B/A, and the spread of the per-round ratios (min..max), which is the run-to-run
noise to judge a ratio against. ``--compiled`` also times B's compiled static decode step.

The left-padded decode workloads time the path where the model reads held padding and positions
from ``state.valid`` (eager: the new tokens' mask only; static: positions counted from it). Their
success criterion, set before the first run: no slowdown, i.e. B/A >= 0.97 or B/A inside its own
per-round spread.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

# Each workload uses only the API both checkouts have; it prints {"value": number}.
COMMON = """
import json, time, torch
from tformer import DecoderLM, TransformerConfig
try:
    from tformer.generation.generate import generate
except ImportError:                       # a checkout from before the layout (tformer.inference)
    from tformer.inference.generate import generate
torch.manual_seed(0)
def report(v): print(json.dumps({"value": v}))
"""
WORKLOADS = {
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
    "train 6L/384 (ctx 256, batch 4): steps/s": """
m = DecoderLM(TransformerConfig.from_name("shakespeare-char")); opt = torch.optim.AdamW(m.parameters(), 1e-3)
x = torch.randint(0, 65, (4, 256)); y = torch.randint(0, 65, (4, 256))
def step():
    _, loss = m(x, targets=y); opt.zero_grad(set_to_none=True); loss.backward(); opt.step()
step()
t = time.perf_counter(); n = 4
for _ in range(n): step()
report(n / (time.perf_counter() - t))
""",
    "decode tiny (200 tokens, greedy): tok/s": """
m = DecoderLM(TransformerConfig.from_name("tiny")).eval(); ids = torch.randint(0, 256, (1, 8))
generate(m, ids, 20, temperature=0)
t = time.perf_counter(); generate(m, ids, 200, temperature=0); report(200 / (time.perf_counter() - t))
""",
    "decode GPT-2 124M fp32 (prompt 32, 48 new): tok/s": """
m = DecoderLM(TransformerConfig.from_name("gpt2-124m")).eval(); ids = torch.randint(0, 50257, (1, 32))
generate(m, ids, 4, temperature=0)
t0 = time.perf_counter(); generate(m, ids, 1, temperature=0); prefill = time.perf_counter() - t0
t = time.perf_counter(); generate(m, ids, 49, temperature=0); report(48 / (time.perf_counter() - t - prefill))
""",
    "decode tiny left-padded (batch 4, 200 tokens, greedy): tok/s": """
m = DecoderLM(TransformerConfig.from_name("tiny")).eval(); ids = torch.randint(0, 256, (4, 16))
mask = torch.ones_like(ids); mask[1:, :5] = 0
generate(m, ids, 20, temperature=0, attention_mask=mask)
t = time.perf_counter(); generate(m, ids, 200, temperature=0, attention_mask=mask); report(200 / (time.perf_counter() - t))
""",
    "decode GPT-2 124M fp32 left-padded (batch 2, prompt 32, 48 new): tok/s": """
m = DecoderLM(TransformerConfig.from_name("gpt2-124m")).eval(); ids = torch.randint(0, 50257, (2, 32))
mask = torch.ones_like(ids); mask[1, :10] = 0; kw = dict(temperature=0, attention_mask=mask)
generate(m, ids, 4, **kw)
t0 = time.perf_counter(); generate(m, ids, 1, **kw); prefill = time.perf_counter() - t0
t = time.perf_counter(); generate(m, ids, 49, **kw); report(48 / (time.perf_counter() - t - prefill))
""",
    "decode GPT-2 124M fp32 left-padded static (batch 2, prompt 32, 48 new): tok/s": """
m = DecoderLM(TransformerConfig.from_name("gpt2-124m")).eval(); ids = torch.randint(0, 50257, (2, 32))
mask = torch.ones_like(ids); mask[1, :10] = 0; kw = dict(temperature=0, attention_mask=mask, static=True)
generate(m, ids, 4, **kw)
t0 = time.perf_counter(); generate(m, ids, 1, **kw); prefill = time.perf_counter() - t0
t = time.perf_counter(); generate(m, ids, 49, **kw); report(48 / (time.perf_counter() - t - prefill))
""",
    "prefill GPT-2 124M fp32 (128 tokens): tok/s": """
m = DecoderLM(TransformerConfig.from_name("gpt2-124m")).eval(); ids = torch.randint(0, 50257, (1, 128))
with torch.inference_mode():
    m(ids, last_only=True)
    t = time.perf_counter(); [m(ids, last_only=True) for _ in range(3)]; report(3 * 128 / (time.perf_counter() - t))
""",
    "encode bert-mini (32 x 64 tokens, padded): seq/s": """
from tformer import EncoderModel
m = EncoderModel(TransformerConfig.from_name("bert-mini")).eval(); ids = torch.randint(0, 30522, (32, 64))
mask = torch.ones(32, 64, dtype=torch.long); mask[::2, 40:] = 0
with torch.inference_mode():
    m(ids, attention_mask=mask)
    t = time.perf_counter(); [m(ids, attention_mask=mask) for _ in range(5)]; report(5 * 32 / (time.perf_counter() - t))
""",
    "decode SmolLM2-135M Q4_1 blocks (prompt 32, 64 new): tok/s": """
from tformer.interop.builtin import builtin_path
from tformer.interop.gguf_import import load_gguf
m = load_gguf(builtin_path("smollm2"), keep_quant=True); ids = torch.randint(0, 49152, (1, 32))
generate(m, ids, 4, temperature=0)
t0 = time.perf_counter(); generate(m, ids, 1, temperature=0); prefill = time.perf_counter() - t0
t = time.perf_counter(); generate(m, ids, 65, temperature=0); report(64 / (time.perf_counter() - t - prefill))
""",
    "decode SmolLM2-135M Q4_1 as opened (open_model, prompt 32, 256 new): tok/s": """
from tformer.inference import open_model
m = open_model("smollm2").model; ids = torch.randint(0, 49152, (1, 32))
generate(m, ids, 4, temperature=0)                    # the first use: waits for tiles still being made
t0 = time.perf_counter(); generate(m, ids, 1, temperature=0); prefill = time.perf_counter() - t0
t = time.perf_counter(); generate(m, ids, 257, temperature=0); report(256 / (time.perf_counter() - t - prefill))
""",
    "serve pool SmolLM2-135M Q4_1 (4 rows, prompt 100, 40 steps): tok/s": """
from tformer.interop.builtin import builtin_path
from tformer.interop.gguf_import import load_gguf
from tformer.serve.pool import KVPool
m = load_gguf(builtin_path("smollm2"), keep_quant=True); pool = KVPool(m, 4, 512)
prompts = [list(range(100 + 7 * r, 200 + 7 * r)) for r in range(4)]
with torch.inference_mode():
    t = pool.prefill([0, 1, 2, 3], prompts).argmax(-1)
    start = time.perf_counter()
    for i in range(40):
        t = pool.decode(t, 101 + i).argmax(-1); t.tolist()
report(4 * 40 / (time.perf_counter() - start))
""",
}
COMPILED = {
    "decode GPT-2 124M fp32, eager static step: tok/s": """
m = DecoderLM(TransformerConfig.from_name("gpt2-124m")).eval(); ids = torch.randint(0, 50257, (1, 32))
generate(m, ids, 4, temperature=0, static=True)
t0 = time.perf_counter(); generate(m, ids, 1, temperature=0, static=True); prefill = time.perf_counter() - t0
t = time.perf_counter(); generate(m, ids, 49, temperature=0, static=True); report(48 / (time.perf_counter() - t - prefill))
""",
    "decode GPT-2 124M fp32, compiled static step: tok/s": """
m = DecoderLM(TransformerConfig.from_name("gpt2-124m")).eval(); ids = torch.randint(0, 50257, (1, 32))
t = time.perf_counter(); generate(m, ids, 4, temperature=0, compile=True); print("compile s", time.perf_counter() - t)
t0 = time.perf_counter(); generate(m, ids, 1, temperature=0, compile=True); prefill = time.perf_counter() - t0
t = time.perf_counter(); generate(m, ids, 49, temperature=0, compile=True); report(48 / (time.perf_counter() - t - prefill))
""",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", type=Path, required=True, help="baseline checkout")
    ap.add_argument("--b", type=Path, required=True, help="candidate checkout")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", nargs="*", default=None, help="substrings of workload names to run")
    ap.add_argument("--compiled", action="store_true", help="also B's static and compiled decode (B only)")
    ap.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/ab/ab_compare.md")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # benchmarks/, for common/
    from common.ab import alternate, ratio_stats, run_workload
    from common.record import Run, results_dir

    out = args.out or results_dir("ab") / "ab_compare.md"
    record = Run()

    names = [n for n in WORKLOADS if not args.only or any(s in n for s in args.only)]
    values = alternate({n: COMMON + WORKLOADS[n] for n in names}, args.a, args.b, args.rounds, args.threads)
    record.finish()
    lines = [f"# A/B: {side_name(args.b)} (B) against {side_name(args.a)} (A)", "",
             f"{args.threads} threads, {args.rounds} alternated rounds.", "",
             "| workload (higher is better) | A median | B median | B/A | per-round B/A min..max |",
             "|---|---:|---:|---:|---|"]
    for n in names:
        a, b = values[n]["A"], values[n]["B"]
        ratio, lo, hi = ratio_stats(a, b)
        lines.append(f"| {n} | {statistics.median(a):.2f} | {statistics.median(b):.2f} | {ratio:.3f} | {lo:.2f}..{hi:.2f} |")
    if args.compiled:
        lines += ["", "B only (one run each):", ""]
        for n, code in COMPILED.items():
            lines.append(f"- {n}: {run_workload(args.b, COMMON + code, args.threads):.2f}")
    text = "\n".join(lines) + "\n"
    print(text)
    record.write(out, text)


def side_name(checkout: Path) -> str:
    """A checkout by its commit (``git rev-parse --short HEAD``, ``+ changes`` when its tracked files
    differ), never by its folder, which means nothing on another machine."""
    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(checkout), *a], capture_output=True, text=True).stdout.strip()
    head = git("rev-parse", "--short", "HEAD") or "unknown commit"
    return f"commit {head}" + (" + changes" if git("status", "--porcelain", "--untracked-files=no") else "")


if __name__ == "__main__":
    main()
