"""Training speed and quality on tinyshakespeare (char), in nanoGPT's CPU configuration.

    flock /tmp/tformer-bench.lock env PYTHONPATH=src python benchmarks/train_shakespeare_char.py

1. Measures the matmul peak (fp32 and bf16) that MFU is reported against.
2. Small config (nanoGPT's documented CPU run): 4 layers, 4 heads, d=128, context 64, batch 12,
   2000 iterations, lr 1e-3 -> 1e-4 cosine over 2000, 100 warmup, dropout 0, AdamW beta2 0.99,
   weight decay 0.1, clipping 1.0, evaluation every 250 iterations on 20 batches of each split.
   First a short alternating probe of 1 vs 2 threads picks the thread count; then one full run
   (with its evaluations and checkpoints) is timed: ms/iter (median), tokens/s, wall, val loss.
3. Large config (nanoGPT's shakespeare_char: 6 layers, 6 heads, d=384, context 256, batch 64,
   dropout 0.2): a few training steps, fp32 and bf16 autocast alternating; median s/iter, tokens/s.
Writes benchmarks/results/train_shakespeare_char.md and the loss curve PNG.

nanoGPT cannot run here (no network); its figures are quoted from the project's issue 3, measured
earlier on this kind of machine (2 cores).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from machine import busy_cores, load_note  # benchmarks/machine.py
from tformer.accounting import training_flops_per_token
from tformer.training.perf import bf16_supported, matmul_peak_flops
from tformer.training.trainer import Trainer

NANOGPT = {"val_loss": 1.8857, "ms_per_iter": 43.0, "ms_fastest": 33.0, "tokens_per_s": 18_000, "wall_s": 95.0,
           "large_s_per_iter": 10.6, "large_tokens_per_s": 1_550}
# nanoGPT's train.py defaults to bias=False (no biases in Linear and LayerNorm); its configs keep that.
SMALL = dict(n_layers=4, n_heads=4, d_model=128, context_length=64, dropout=0.0, bias=False, batch_size=12, max_steps=2000,
             lr=1e-3, min_lr=1e-4, decay_steps=2000, warmup_steps=100, beta2=0.99, weight_decay=0.1, grad_clip=1.0,
             eval_interval=250, eval_batches=20, val_fraction=0.1, tokenizer="char", sample_tokens=0)
LARGE = dict(n_layers=6, n_heads=6, d_model=384, context_length=256, dropout=0.2, bias=False, batch_size=64, lr=1e-3,
             beta2=0.99, weight_decay=0.1, grad_clip=1.0, eval_batches=1, tokenizer="char", sample_tokens=0)
SMALL_SEED = 1337  # TrainConfig's default seed
RESULTS = Path(__file__).resolve().parent / "results"


def trainer(data: str, out: str, overrides: dict, **kw) -> Trainer:
    return Trainer.create({**overrides, **kw, "data": data, "out_dir": out, "progress": False},
                          log=lambda m: None)


def time_steps(tr: Trainer, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        tr._train_step(tr.cfg.lr)
        tr.step += 1
        times.append(time.perf_counter() - t)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=None, help="tinyshakespeare.txt (default: ../shared/data/ next to the repo)")
    ap.add_argument("--steps", type=int, default=2000, help="iterations of the small run (default 2000)")
    ap.add_argument("--large-steps", type=int, default=5, help="timed steps per precision, large config")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="small run precision")
    ap.add_argument("--extra-seeds", type=int, default=0,
                    help="also train the small config with seeds 1..N (val loss only: run-to-run spread)")
    args = ap.parse_args()
    root = Path(__file__).resolve().parents[1]
    candidates = [root.parent / "shared/data/tinyshakespeare.txt", root.parent.parent / "shared/data/tinyshakespeare.txt"]
    data = args.data or str(next((c for c in candidates if c.is_file()), candidates[0]))
    if not os.path.isfile(data):
        print(f"error: {data} not found; pass --data PATH to tinyshakespeare.txt", file=sys.stderr)
        return 2
    load = busy_cores()
    print(load_note(load), flush=True)
    tmp = tempfile.mkdtemp(prefix="tformer-bench-")

    # --- thread probe: alternate 1 and 2 threads, 3 rounds x 20 steps each
    probe = {1: [], 2: []}
    trs = {n: trainer(data, f"{tmp}/probe{n}", SMALL, threads=n, precision=args.precision) for n in probe}
    for _ in range(3):
        for n, tr in trs.items():
            torch.set_num_threads(n)
            probe[n] += time_steps(tr, 20)[2:]
    med = {n: statistics.median(v) for n, v in probe.items()}
    threads = min(med, key=med.get)
    torch.set_num_threads(threads)          # the peak is measured with the threads the runs use
    peak32 = matmul_peak_flops(torch.float32)
    peak16 = matmul_peak_flops(torch.bfloat16) if bf16_supported() else float("nan")
    print(f"matmul peak ({threads} thread(s)): fp32 {peak32 / 1e9:.0f} GFLOP/s, bf16 {peak16 / 1e9:.0f} GFLOP/s",
          flush=True)
    print(f"thread probe (median ms/iter): " + ", ".join(f"{n} thread(s) {1e3 * m:.1f}" for n, m in med.items())
          + f" -> {threads}", flush=True)

    # --- the full small run
    t0 = time.perf_counter()
    tr = trainer(data, f"{tmp}/small", {**SMALL, "max_steps": args.steps, "decay_steps": args.steps},
                 threads=threads, precision=args.precision, log_interval=1)
    result = tr.fit()
    wall = time.perf_counter() - t0
    steps = [r for r in result["history"] if "loss" in r]
    evals = [r for r in result["history"] if "val_loss" in r]
    ms = statistics.median(r["ms_per_step"] for r in steps)
    mean_ms = statistics.fmean(r["ms_per_step"] for r in steps)
    fastest = min(r["ms_per_step"] for r in steps)
    tok_s = SMALL["batch_size"] * SMALL["context_length"] / (ms / 1e3)
    fpt = training_flops_per_token(tr.model.config)
    peak = peak32 if args.precision == "fp32" else peak16
    small = {"val_loss": evals[-1]["val_loss"], "ms_per_iter": ms, "ms_fastest": fastest, "tokens_per_s": tok_s,
             "wall_s": wall, "mfu": fpt * tok_s / peak, "mean_ms": mean_ms, "eval_save_s": result["eval_save_s"],
             "train_s": sum(r["ms_per_step"] for r in steps) / 1e3}
    print(f"small: val {small['val_loss']:.4f} at {args.steps}, {ms:.1f} ms/iter (fastest {fastest:.1f}), "
          f"mean {mean_ms:.1f}, {tok_s:,.0f} tok/s, wall {wall:.1f} s (steps {small['train_s']:.1f} s, "
          f"evaluations + checkpoints {small['eval_save_s']:.1f} s), MFU {100 * small['mfu']:.1f}%", flush=True)

    # --- large config: fp32 and bf16 alternating
    large = {}
    trs = {p: trainer(data, f"{tmp}/large-{p}", LARGE, precision=p, threads=threads)
           for p in (["fp32", "bf16"] if bf16_supported() else ["fp32"])}
    times = {p: [] for p in trs}
    for p, t in trs.items():
        time_steps(t, 1)                                                  # warm-up, not counted
    for _ in range(args.large_steps):
        for p, t in trs.items():
            times[p] += time_steps(t, 1)
    for p, ts in times.items():
        s = statistics.median(ts)
        tps = LARGE["batch_size"] * LARGE["context_length"] / s
        fpt = training_flops_per_token(trs[p].model.config)
        large[p] = {"s_per_iter": s, "tokens_per_s": tps, "mfu": fpt * tps / (peak32 if p == "fp32" else peak16)}
        print(f"large {p}: {s:.2f} s/iter, {tps:,.0f} tok/s, MFU {100 * large[p]['mfu']:.1f}%", flush=True)
    seeds = {SMALL_SEED: small["val_loss"]}
    for seed in range(1, args.extra_seeds + 1):
        r = trainer(data, f"{tmp}/seed{seed}", {**SMALL, "max_steps": args.steps, "decay_steps": args.steps},
                    threads=threads, precision=args.precision, seed=seed).fit()
        seeds[seed] = [h for h in r["history"] if "val_loss" in h][-1]["val_loss"]
        print(f"seed {seed}: val loss {seeds[seed]:.4f} at {args.steps}", flush=True)
    small["seeds"] = seeds
    load_end = busy_cores()

    write_report(small, large, steps, evals, args, threads, med, peak32, peak16, load, load_end)
    return 0


def write_report(small, large, steps, evals, args, threads, med, peak32, peak16, load, load_end) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    RESULTS.mkdir(exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in steps], [r["loss"] for r in steps], lw=0.6, alpha=0.6, label="train (per step)")
    ax.plot([r["step"] for r in evals], [r["train_loss"] for r in evals], "o-", label="train (eval, 20 batches)")
    ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "s-", label="val (eval, 20 batches)")
    ax.axhline(1.89, color="gray", ls="--", lw=0.8, label="goal 1.89")
    ax.set(xlabel="iteration", ylabel="loss (nats/char)", ylim=(1.0, 4.5),
           title="tformer, tinyshakespeare char, nanoGPT CPU config")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "train_shakespeare_char_loss.png", dpi=110)
    best = max(large.values(), key=lambda r: r["tokens_per_s"])
    bestp = max(large, key=lambda p: large[p]["tokens_per_s"])
    n = NANOGPT
    lines = [
        "# Training benchmark: tinyshakespeare, character level (nanoGPT's CPU configurations)",
        "",
        f"Machine: {os.cpu_count()} cores, torch {torch.__version__}; before: {load_note(load)}; "
        f"after: {load_note(load_end)}.",
        f"Measured matmul peak (1024² fp32 / bf16 matmul probe, {threads} thread(s)): {peak32 / 1e9:.0f} / {peak16 / 1e9:.0f} GFLOP/s. "
        f"Thread probe (median ms/iter, small config): " + ", ".join(f"{k}: {1e3 * v:.1f}" for k, v in med.items())
        + f" -> {threads} thread(s).",
        "nanoGPT figures are quoted from the project's issue 3 (measured earlier on this kind of 2-core machine); "
        "nanoGPT could not be run here (no network).",
        "",
        f"## Small config: 4 layers, 4 heads, d=128, context 64, batch 12, {args.steps} iterations ({args.precision})",
        "",
        "| | tokens/s (at median) | ms/iter median | fastest | mean | wall, whole run | val loss @2000 | MFU |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        f"| tformer (measured) | {small['tokens_per_s']:,.0f} | {small['ms_per_iter']:.1f} | {small['ms_fastest']:.1f} | "
        f"{small['mean_ms']:.1f} | {small['wall_s']:.1f} s | {small['val_loss']:.4f} | {100 * small['mfu']:.1f}% |",
        f"| nanoGPT (quoted) | ≈{n['tokens_per_s']:,} | {n['ms_per_iter']:.0f} | {n['ms_fastest']:.0f} | | {n['wall_s']:.0f} s | "
        f"{n['val_loss']:.4f} | |",
        f"| ratio tformer / nanoGPT | {small['tokens_per_s'] / n['tokens_per_s']:.2f}× | | | | "
        f"{small['wall_s'] / n['wall_s']:.2f}× | | |",
        "",
        f"Wall breakdown: {small['train_s']:.1f} s in the {args.steps} steps (sum of per-step times), "
        f"{small['eval_save_s']:.1f} s in the {len(evals)} evaluations (20 batches per split) and checkpoints, the rest setup.",
        "",
        "Val loss at the last iteration by seed (same data, same configuration; run-to-run spread): "
        + ", ".join(f"seed {k}: {v:.4f}" for k, v in small["seeds"].items())
        + (f"; mean {statistics.fmean(small['seeds'].values()):.4f}." if len(small["seeds"]) > 1 else "."),
        "",
        "Goal: val loss ≤ 1.89 at 2000 iterations in ≤ half nanoGPT's wall (≤ 47.5 s): "
        f"val loss {'met' if small['val_loss'] <= 1.89 else 'NOT met'}, wall {'met' if small['wall_s'] <= 47.5 else 'NOT met'}. "
        "Wall = creating the run (corpus from the cache) + training + 9 evaluations + checkpoints.",
        "",
        "## Large config: 6 layers, 6 heads, d=384, context 256, batch 64, dropout 0.2",
        "",
        "| | tokens/s | s/iter (median) | MFU (vs same-precision peak) |",
        "|---|---:|---:|---:|",
        *[f"| tformer {p} (measured, {args.large_steps} steps) | {r['tokens_per_s']:,.0f} | {r['s_per_iter']:.2f} | "
          f"{100 * r['mfu']:.1f}% |" for p, r in large.items()],
        f"| nanoGPT fp32 (quoted) | ≈{n['large_tokens_per_s']:,} | {n['large_s_per_iter']:.1f} | |",
        f"| ratio tformer {bestp} / nanoGPT | {best['tokens_per_s'] / n['large_tokens_per_s']:.2f}× | | |",
        "",
        "Goal: ≥ 2× nanoGPT's tokens/s: " + ("met." if best["tokens_per_s"] >= 2 * n["large_tokens_per_s"] else "NOT met."),
        "",
        f"Reproduce: `flock /tmp/tformer-bench.lock env PYTHONPATH=src .venv/bin/python benchmarks/train_shakespeare_char.py"
        + (f" --extra-seeds {args.extra_seeds}" if args.extra_seeds else "") + "`",
        "",
        "![loss curve](train_shakespeare_char_loss.png)",
    ]
    (RESULTS / "train_shakespeare_char.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
