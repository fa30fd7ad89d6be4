"""Float decode weights on 2 MB pages against 4 KB pages: GPT-2 124M decode and prefill, A/B in one run.

For each float precision, two copies of the same model: one whose fused-decode plan copied the weights
a step streams into qgemv's arenas of 2 MB pages, in the step's order (``fused_decode._stream``, the
default), one made with ``TFORMER_FLOAT_ARENA=0`` (the weights where torch allocated them: 4 KB pages
on a kernel whose THP setting is ``madvise``). Block formats are not compared: their tiles have been
made in those arenas since they exist. Each round runs one generation on each, alternated; decode tok/s =
(n - 1) / (whole - prefill). Criterion, stated before the run: the arena is worth its copy at the
first step if the median of per-round decode-time ratios (arena / plain) is <= 0.97 at fp32 and fp16,
with the same tokens from both copies.

    flock /tmp/tformer-bench.lock env PYTHONPATH=$PWD/src .venv/bin/python benchmarks/quant/huge_pages.py

Writes benchmarks/results/quant/huge_pages[-TAG].md.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from tformer import DecoderLM, TransformerConfig
from tformer.generation.generate import generate
from tformer.quant import fused_decode, qgemv
from tformer.quant.quantize import set_precision

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # benchmarks/, for common/
from common.measure import read_bandwidth  # noqa: E402
from common.record import Run, load_note, results_dir  # noqa: E402


def planned(model: DecoderLM, ids: torch.Tensor, arena: bool) -> DecoderLM:
    """``model`` after its first generation made its plan with the arena on or off."""
    before = os.environ.get(fused_decode.FLOAT_ARENA)
    os.environ[fused_decode.FLOAT_ARENA] = "1" if arena else "0"
    try:
        generate(model, ids, 2, temperature=0)
    finally:
        if before is None:
            del os.environ[fused_decode.FLOAT_ARENA]
        else:
            os.environ[fused_decode.FLOAT_ARENA] = before
    return model


def _huge_mb(model: DecoderLM) -> float:
    """MB on 2 MB pages in the mappings that hold the matrices a step streams (each mapping once)."""
    plan = fused_decode.plan(model)
    if plan is None:
        return float("nan")
    mats = [m for layer in plan.layers for m in layer[1]] + [model.lm_head.weight]
    return (qgemv.huge_page_bytes(mats) or 0) / 2**20


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def run(precision: str, base: DecoderLM, ids: torch.Tensor, new: int, rounds: int) -> dict:
    arena = planned(set_precision(copy.deepcopy(base), precision), ids, True)
    plain = planned(set_precision(copy.deepcopy(base), precision), ids, False)
    huge_mb = [_huge_mb(m) for m in (arena, plain)]
    same = torch.equal(generate(arena, ids, new, temperature=0), generate(plain, ids, new, temperature=0))
    step = {"arena": [], "plain": []}
    pre = {"arena": [], "plain": []}
    for _ in range(rounds):
        for name, m in (("arena", arena), ("plain", plain)):
            whole = timed(lambda m=m: generate(m, ids, new, temperature=0))
            p = timed(lambda m=m: generate(m, ids, 1, temperature=0))
            step[name].append((whole - p) / (new - 1))
            pre[name].append(p)
    ratio = statistics.median(a / b for a, b in zip(step["arena"], step["plain"]))
    pre_ratio = statistics.median(a / b for a, b in zip(pre["arena"], pre["plain"]))
    return {"precision": precision, "huge_mb": huge_mb, "same": same,
            "arena_ms": statistics.median(step["arena"]) * 1e3, "plain_ms": statistics.median(step["plain"]) * 1e3,
            "ratio": ratio, "range": (min(a / b for a, b in zip(step["arena"], step["plain"])),
                                      max(a / b for a, b in zip(step["arena"], step["plain"]))),
            "prefill_ratio": pre_ratio}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--precisions", nargs="+", default=["fp32", "fp16", "bf16"])
    p.add_argument("--tag", default="")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    record = Run()
    print(load_note(record.busy_before), file=sys.stderr)
    bw = read_bandwidth()
    torch.manual_seed(0)
    config = TransformerConfig.from_name("gpt2-124m")
    base = DecoderLM(config).eval()
    ids = torch.randint(0, config.vocab_size, (1, args.prompt))
    rows = []
    for precision in args.precisions:
        print(f"{precision} ...", file=sys.stderr, flush=True)
        rows.append(run(precision, base, ids, args.new, args.rounds))
        r = rows[-1]
        print(f"  arena {r['arena_ms']:.2f} ms, plain {r['plain_ms']:.2f} ms a token: {r['ratio']:.3f}", file=sys.stderr)
    record.finish()
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    lines = ["# Float decode weights on 2 MB pages (qgemv's arenas) against 4 KB pages, GPT-2 124M\n",
             f"Measured read bandwidth {bw:.1f} GB/s at the start. THP setting: "
             f"`{thp.read_text().strip() if thp.exists() else 'no such file'}`. Prompt {args.prompt}, "
             f"{args.new} new tokens, greedy; {args.rounds} rounds, the two copies alternated in each. Ratio: "
             f"median over rounds of arena / plain decode time per token (range over rounds); prefill the same "
             f"for the prompt's time.\n",
             "| precision | MB on 2 MB pages where the streamed matrices lie, arena / plain | arena ms/token | plain ms/token | "
             "decode time ratio | range | prefill time ratio | same tokens |",
             "|---|---:|---:|---:|---:|---|---:|---|"]
    for r in rows:
        lines.append(f"| {r['precision']} | {r['huge_mb'][0]:.0f} / {r['huge_mb'][1]:.0f} MB | {r['arena_ms']:.2f} | {r['plain_ms']:.2f} | "
                     f"{r['ratio']:.3f} | {r['range'][0]:.3f}-{r['range'][1]:.3f} | {r['prefill_ratio']:.3f} | "
                     f"{'yes' if r['same'] else 'NO'} |")
    text = "\n".join(lines)
    suffix = f"-{args.tag}" if args.tag else ""
    record.write(results_dir("quant") / f"huge_pages{suffix}.md", text + "\n")
    print(text)


if __name__ == "__main__":
    main()
