"""Where a decode step's time goes: torch.profiler over GPT-2 124M decode steps, eager and compiled.

For each mode, the ops that take the most self CPU time per decode step, and how much of the step the
weight-reading products (GEMV/GEMM calls) take: the rest is per-op overhead that bandwidth does not
explain. Question asked before the run: why is the compiled static step not faster than eager?

    flock /tmp/tformer-bench.lock env PYTHONPATH=$PWD/src .venv/bin/python benchmarks/generation/decode_profile.py

Writes benchmarks/results/generation/decode_profile.md.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from tformer import DecoderLM, TransformerConfig
from tformer.generation.generate import generate
from tformer.quant.quantize import set_precision

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # benchmarks/, for common/
from common.record import Run, load_note, results_dir  # noqa: E402

PRODUCTS = ("mm", "addmm", "mv", "addmv_", "linear", "gemv", "gemv_q4", "_weight_int8pack_mm", "_weight_int4pack_mm_for_cpu", "bmm",
            "mkldnn", "mkl_linear")


def modes(base: DecoderLM) -> dict:
    """name -> (model, generate options)."""
    plain = base                                          # nn.Linear, as benchmarks/generation/decode_compiled.py runs it
    return {
        "eager bf16 (set_precision)": (set_precision(copy.deepcopy(base), "bf16"), {}),
        "eager int8 (set_precision)": (set_precision(copy.deepcopy(base), "int8"), {}),
        "eager fp32 (set_precision)": (set_precision(copy.deepcopy(base), "fp32"), {}),
        "eager fp32 (nn.Linear)": (plain, {}),
        "static fp32 (nn.Linear)": (plain, {"static": True}),
        "compiled fp32 (nn.Linear)": (plain, {"compile": True}),       # last: its first call compiles
    }


def profile_mode(model, opts: dict, ids: torch.Tensor, steps: int) -> tuple[float, list, float]:
    generate(model, ids, 4, temperature=0, **opts)                                  # warm-up / compile
    t = time.perf_counter()
    generate(model, ids, 1, temperature=0, **opts)
    pre = time.perf_counter() - t
    t = time.perf_counter()
    generate(model, ids, steps + 1, temperature=0, **opts)
    per_step = (time.perf_counter() - t - pre) / steps
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        generate(model, ids, steps + 1, temperature=0, **opts)
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    events.sort(key=lambda e: -e.self_cpu_time_total)
    prod = sum(e.self_cpu_time_total for e in events if e.key.split("::")[-1] in PRODUCTS or "gemv" in e.key)
    return per_step, [(e.key, e.self_cpu_time_total / total, e.count / (steps + 1)) for e in events[:12]], prod / total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--out", default=str(results_dir("generation") / "decode_profile.md"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    run = Run()
    torch.manual_seed(0)
    base = DecoderLM(TransformerConfig.from_name("gpt2-124m")).eval()
    ids = torch.randint(0, 50257, (1, 32), generator=torch.Generator().manual_seed(1))
    lines = ["# Where a GPT-2 124M decode step's time goes (torch.profiler)\n",
             f"Prompt 32, {args.steps} decode steps. Self CPU time per op, as a share of all profiled self time "
             f"(the profiler's own overhead inflates small ops); calls per step.\n"]
    for name, (model, opts) in modes(base).items():
        per_step, top, prod = profile_mode(model, opts, ids, args.steps)
        lines += [f"## {name}: {1 / per_step:.1f} tok/s unprofiled; products (mm/addmm/mv/linear/gemv/int8pack) "
                  f"{prod:.0%} of profiled self time\n", "| op | share | calls per step |", "|---|---:|---:|"]
        lines += [f"| `{k}` | {s:.1%} | {c:.0f} |" for k, s, c in top]
        lines.append("")
        print("\n".join(lines[-16:]), flush=True)
        run.write(args.out, "\n".join(lines) + "\n")                              # a timeout later keeps it
    run.finish()
    run.write(args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
