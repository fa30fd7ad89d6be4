"""Eager, static and compiled decode in one run, alternated: GPT-2 124M shape, batch 1, prompt 32 + 48
new tokens, greedy, fp32. Says which of the three generation should use by default.

    flock /tmp/tformer-bench.lock env PYTHONPATH=$PWD/src .venv/bin/python benchmarks/generation/decode_compiled.py

Per round and mode, decode tok/s = 48 / (time of 49 new tokens - time of 1 new token): the prefill and
the first token are taken out. Writes benchmarks/results/generation/decode_compiled.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from tformer import DecoderLM, TransformerConfig, generate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # benchmarks/, for common/
from common.record import Run, load_note, results_dir  # noqa: E402

MODES = (("eager", {}), ("static", {"static": True}), ("compiled", {"compile": True}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--out", default=str(results_dir("generation") / "decode_compiled.md"))
    args = p.parse_args()
    run = Run()
    print(load_note(run.busy_before), flush=True)
    torch.manual_seed(0)
    m = DecoderLM(TransformerConfig.from_name("gpt2-124m")).eval()
    ids = torch.randint(0, 50257, (1, 32))
    t = time.perf_counter()
    generate(m, ids, 4, temperature=0, compile=True)
    first = time.perf_counter() - t
    print(f"first compiled call {first:.1f} s", flush=True)
    generate(m, ids, 4, temperature=0)
    n = args.new_tokens

    def rate(**kw) -> float:
        t0 = time.perf_counter()
        generate(m, ids, 1, temperature=0, **kw)
        pre = time.perf_counter() - t0
        t1 = time.perf_counter()
        generate(m, ids, n + 1, temperature=0, **kw)
        return n / (time.perf_counter() - t1 - pre)

    res: dict[str, list[float]] = {k: [] for k, _ in MODES}
    for _ in range(args.rounds):
        for k, kw in MODES:
            res[k].append(rate(**kw))
    eager = statistics.median(res["eager"])
    lines = [f"# Decode: eager, static and compiled (GPT-2 124M shape, batch 1, prompt 32 + {n} new tokens, greedy, fp32)",
             "", f"{args.rounds} alternated rounds; the first compiled call (compilation) took {first:.1f} s.", "",
             "| mode | decode tok/s, median | min | max | × eager |", "|---|---:|---:|---:|---:|"]
    for k, v in res.items():
        lines.append(f"| {k} | {statistics.median(v):.1f} | {min(v):.1f} | {max(v):.1f} | "
                     f"{statistics.median(v) / eager:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    run.write(args.out, text)


if __name__ == "__main__":
    main()
