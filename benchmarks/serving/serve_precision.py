"""Which precision `tformer serve` should run SmolLM2 at on this CPU: the pool's decode step and a
prefill, fp32 against bf16 (AMX / AVX-512-BF16 here: ``tformer.machine.bf16_supported``), alternating.

For batch sizes 1, 8 and 16 it times ``KVPool.decode`` (rows holding 320 tokens, as a chat with its
system prompt does) and a batched prefill of 8 prompts of 320 tokens; medians of ``--rounds``.
Criterion (before the run): serve at the precision with the higher decode tokens/s at 8 streams,
unless it loses more than 10% at 1 stream.

    flock -w 900 /tmp/tformer-bench.lock timeout 300 env PYTHONPATH=src python benchmarks/serving/serve_precision.py
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.record import Run, results_dir  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--held", type=int, default=320)
    args = ap.parse_args()
    run = Run()
    from tformer.checkpoint import load_model
    from tformer.interop.builtin import resolve_model
    from tformer.machine import bf16_supported
    from tformer.quant.quantize import set_precision
    from tformer.serve.pool import KVPool

    base = load_model(resolve_model("smollm2")).eval()
    models = {p: set_precision(copy.deepcopy(base), p) for p in ("fp32", "bf16")}
    pools = {p: KVPool(m, 16, 1024) for p, m in models.items()}
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, base.config.vocab_size, (args.held,), generator=g).tolist() for _ in range(16)]
    times = {(p, what): [] for p in models for what in ("decode1", "decode8", "decode16", "prefill8")}
    for p, pool in pools.items():
        pool.prefill(list(range(16)), prompts)
    for r in range(args.rounds):
        for p in (list(pools) if r % 2 == 0 else list(reversed(pools))):
            pool = pools[p]
            for b in (1, 8, 16):
                t = time.perf_counter()
                for _ in range(4):
                    pool.decode(torch.ones(b, dtype=torch.long), args.held + 8)
                times[(p, f"decode{b}")].append((time.perf_counter() - t) / 4)
                pool.state.hold(torch.arange(16), torch.full((16,), args.held))     # back to the held prompts
            t = time.perf_counter()
            pool.prefill(list(range(8)), prompts[:8])
            times[(p, "prefill8")].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    lines = ["# Serving precision for SmolLM2 on this CPU: fp32 against bf16", "",
             f"bf16 supported natively: {bf16_supported()}. KVPool decode step with rows holding {args.held} tokens, "
             f"and a prefill of 8 prompts x {args.held} tokens; medians of {args.rounds} rounds, alternating.", "",
             "| precision | decode b=1 tok/s | b=8 tok/s | b=16 tok/s | prefill 8x tokens/s |", "|---|---:|---:|---:|---:|"]
    for p in models:
        lines.append(f"| {p} | {1 / med[(p, 'decode1')]:.1f} | {8 / med[(p, 'decode8')]:.1f} | "
                     f"{16 / med[(p, 'decode16')]:.1f} | {8 * args.held / med[(p, 'prefill8')]:.0f} |")
    best = max(models, key=lambda p: 1 / med[(p, "decode8")])
    other = "fp32" if best == "bf16" else "bf16"
    if med[(best, "decode1")] > 1.1 * med[(other, "decode1")]:
        best = other
    lines += ["", f"Chosen for serving by the criterion: **{best}**."]
    run.finish()
    print(run.write(results_dir("serving") / "serve_precision.md", "\n".join(lines)).read_text())


if __name__ == "__main__":
    main()
