"""What one training step costs under each recipe at nanoGPT's CPU configuration (4L/4H/128, context 64,
batch 12), in one process, contenders alternated block by block on the same batches.

    flock -w 900 /tmp/tformer-bench.lock timeout 300 env PYTHONPATH=src python benchmarks/training/recipe_step_cost.py

Contenders: ``classic`` (nanoGPT's architecture, fused AdamW) and ``fast`` (Muon on the hidden matrices, QK-norm,
ReLU², soft-cap), each in bf16 autocast (where the CPU has native bf16) and fp32; and ``fast`` with the model
compiled (``compile=true``: inductor's C++ backend), whose first steps' compile time is reported apart, with the
number of steps it must run to repay it. Each contender's steps are the trainer's own ``_train_step``. Reported:
median ms/step over the blocks (a block = ``--steps`` steps, after ``--warmup`` untimed steps each).
Criterion stated before the run: a compiled step is worth making a default only if its compile time is repaid
within the default's steps (1000) at this size.
Writes benchmarks/results/training/recipe_step_cost.md.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # benchmarks/, for common/
from common.record import Run, results_dir  # noqa: E402
from tformer.machine import bf16_supported  # noqa: E402

SHAPE = dict(n_layers=4, n_heads=4, d_model=128, context_length=64, dropout=0.0, bias=False, batch_size=12,
             eval_interval=10**6, sample_tokens=0, progress=False, device="cpu")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    root = Path(__file__).resolve().parents[2]                 # ../shared next to the repository (or a worktree's parent)
    shared = next((c for c in (root.parent / "shared", root.parent.parent / "shared") if c.exists()), root.parent / "shared")
    ap.add_argument("--data", default=str(shared / "data" / "tinyshakespeare.txt"))
    ap.add_argument("--steps", type=int, default=20, help="timed steps per block (default 20)")
    ap.add_argument("--blocks", type=int, default=5, help="alternated blocks per contender (default 5)")
    ap.add_argument("--warmup", type=int, default=10, help="untimed steps first (default 10)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled contender")
    args = ap.parse_args()
    run = Run()
    import torch
    from tformer.training.trainer import Trainer
    tmp = tempfile.mkdtemp(prefix="tformer-steps-")
    precisions = ["bf16", "fp32"] if bf16_supported() else ["fp32"]
    wanted = {f"{r} {p}": dict(recipe=r, precision=p) for r in ("classic", "fast") for p in precisions}
    if not args.no_compile:
        wanted[f"fast {precisions[0]} compiled"] = dict(recipe="fast", precision=precisions[0], compile=True)
    trainers, first = {}, {}
    for name, kw in wanted.items():
        tr = Trainer.create({**SHAPE, **kw, "threads": args.threads, "data": args.data, "cache_dir": f"{tmp}/cache",
                             "out_dir": f"{tmp}/{name.replace(' ', '-')}"}, log=lambda m: None)
        t = time.perf_counter()
        for _ in range(args.warmup):                                  # compiles here, for the compiled one
            tr._train_step(1e-3)
            tr.step += 1
        first[name] = time.perf_counter() - t
        trainers[name] = tr
    times = {k: [] for k in trainers}
    for _ in range(args.blocks):
        for name, tr in trainers.items():
            t = time.perf_counter()
            for _ in range(args.steps):
                tr._train_step(1e-3)
                tr.step += 1
            times[name].append((time.perf_counter() - t) / args.steps)
    med = {k: statistics.median(v) for k, v in times.items()}
    ref = med[f"classic {precisions[0]}"]
    lines = ["# Step cost by recipe: 4L/4H/128, context 64, batch 12", "",
             f"{args.blocks} alternated blocks of {args.steps} steps per contender after {args.warmup} untimed warm-up "
             f"steps, {args.threads} threads, torch {torch.__version__}. Criterion (before the run): compile is worth a "
             "default only if its compile time is repaid within 1000 steps.", "",
             "| contender | ms/step (median) | vs classic " + precisions[0] + f" | first {args.warmup} steps (s) |",
             "|---|---:|---:|---:|"]
    for k, v in med.items():
        lines.append(f"| {k} | {1e3 * v:.1f} | {v / ref:.2f}x | {first[k]:.1f} |")
    comp = f"fast {precisions[0]} compiled"
    if comp in med:
        plain = med[f"fast {precisions[0]}"]
        extra = first[comp] - args.warmup * med[comp]
        gain = plain - med[comp]
        repay = extra / gain if gain > 0 else float("inf")
        lines += ["", f"Compiling costs about {extra:.1f} s (its warm-up less {args.warmup} compiled steps) and saves "
                      f"{1e3 * gain:.1f} ms/step: repaid after {repay:.0f} steps."]
    run.write(results_dir("training") / "recipe_step_cost.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
