"""Induction heads length extrapolation (Mamba paper, Table 2 / Figure 2 right) at CPU size.

    PYTHONPATH=$PWD/src OMP_NUM_THREADS=1 python benchmarks/mamba/mamba_induction.py --model mamba      # one model
    PYTHONPATH=$PWD/src OMP_NUM_THREADS=1 python benchmarks/mamba/mamba_induction.py --model attention  # (in parallel)
    PYTHONPATH=$PWD/src python benchmarks/mamba/mamba_induction.py --report                            # table + plot

The task (:func:`mamba_tasks.induction_heads`): 256 random tokens from a vocabulary of 16, a special
token placed once at random and followed by a key token, and the special token again at the end;
the model must output the key. Chance is 1/16 = 6.25%. Each model (2 layers, d=64) trains on fresh
batches of length 256 until its accuracy on 256 held-out length-256 sequences reaches 99% (checked
every 100 steps) or ``--steps`` run out, then is tested on 256 new sequences at each length 256, 512,
..., 16384 (fewer at the longest lengths, see ``COUNT``). Each ``--model`` run writes
``results/mamba_induction_<model>.json``; ``--report`` turns them into ``mamba_induction.{md,png}``.

Models: ``mamba`` (selective, E=128, N=16, no feed-forward), ``lti`` (the same with
``selective=False``), ``attention`` (4 heads, RoPE, SwiGLU feed-forward).

Success criterion, fixed before the run (the paper's finding, qualitatively): a model counts only if
it reaches 99% at length 256. Mamba reproduces the paper if it then stays >= 90% at every test length
up to 16384 (64x the training length); attention with RoPE reproduces it if it falls below 50% at
1024 (4x) and beyond.

What happened (2026-11-29, busy 2-core CPU): at length 256 neither model left chance within the
budget (Mamba: 4,000 steps of 16 in 36 min; attention: 4,000 steps of 8); a user of the reference code
reports ~40k steps of 8 (state-spaces/mamba issue 62). So the runs in the table also train at 32 and
64 (``--train-len``) and are judged by the same criterion relative to their own training length.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # benchmarks/, for common/
from common.record import Run, results_dir  # noqa: E402

import torch
from tqdm import tqdm

from mamba_tasks import accuracy, attention_config, induction_heads, mamba_config, run_or_report, train

RESULTS = results_dir("mamba")
LABELS = {"mamba": "Mamba (selective)", "lti": "Mamba LTI ablation", "attention": "attention + RoPE"}
COUNT = {2048: 128, 4096: 64, 8192: 32, 16384: 16}  # test sequences at the longest lengths (256 below)


def build(name: str, d: int, context: int):
    if name == "attention":
        return attention_config(17, d=d, context=context)
    return mamba_config(17, d=d, context=context, selective=name == "mamba")


def run(args) -> None:
    record = Run()
    lengths = [args.train_len * 2 ** k for k in range(16) if args.train_len * 2 ** k <= args.max_len]
    config = build(args.model, args.d, lengths[-1])
    held_out = induction_heads(256, args.train_len, g=torch.Generator().manual_seed(1))
    model, losses, seconds, steps = train(config, partial(induction_heads, T=args.train_len), args.steps,
                                          args.batch, lr=args.lr, desc=args.model, stop=(*held_out, 100, 0.99),
                                          max_seconds=60 * args.minutes)
    accs = {}
    for n in tqdm(lengths, desc=f"{args.model} test"):
        ids, targets = induction_heads(COUNT.get(n, 256), n, g=torch.Generator().manual_seed(n))
        accs[n] = accuracy(model, ids, targets, batch=max(1, 8192 // n))
        tqdm.write(f"{args.model} length {n}: {100 * accs[n]:.1f}%")
    out = dict(model=args.model, d=args.d, steps=steps, max_steps=args.steps, batch=args.batch, lr=args.lr,
               train_len=args.train_len, minutes=args.minutes, params=model.num_parameters(), seconds=seconds,
               final_loss=sum(losses[-50:]) / len(losses[-50:]), accuracy={str(n): a for n, a in accs.items()},
               count={str(n): COUNT.get(n, 256) for n in lengths}, load=open("/proc/loadavg").read().split()[:3])
    record.write_json(RESULTS / f"mamba_induction_{args.model}{args.tag}.json", out)


def report() -> None:
    runs = [json.loads(p.read_text()) for m in LABELS for p in sorted(RESULTS.glob(f"mamba_induction_{m}*.json"))]
    lengths = sorted({int(n) for r in runs for n in r["accuracy"]})
    lines = ["# Induction heads: trained short, tested up to 16384", "",
             "Vocabulary 16, the key follows the first special token; accuracy of the final prediction "
             "(chance 6.25%). 2 layers, d=64; Mamba: E=128, N=16, no feed-forward; attention: 4 heads, RoPE, "
             "SwiGLU. AdamW, cosine schedule, fresh batches; training stops once 256 held-out sequences of "
             "the training length reach 99% (checked every 100 steps) or its time is up. Test: 256 sequences per length "
             f"({', '.join(f'{c} at {n}' for n, c in COUNT.items())}).", "",
             "Criterion (fixed before the run): Mamba >= 90% at every length to 16384; attention + RoPE "
             "< 50% from 4x the training length on. Paper (Table 2, trained at 256): Mamba stays near perfect up "
             "to million-token sequences, every attention variant falls towards chance soon past its training "
             "length.", "",
             "1 thread per model, on a shared busy machine (load averages in the table; seconds are not "
             "comparable; each run's commit and command are in its JSON file under \"recorded\").", "",
             "| model | train length | params | steps | batch | lr | train s | load | " + " | ".join(str(n) for n in lengths) + " |",
             "|---|---:|---:|---:|---:|---:|---:|---|" + "---:|" * len(lengths)]
    for r in runs:
        lines.append(f"| {LABELS[r['model']]} | {r['train_len']} | {r['params']:,} | {r['steps']} | {r['batch']} | {r['lr']:g} | "
                     f"{r['seconds']:.0f} | {' '.join(r['load'])} | "
                     + " | ".join(f"{100 * r['accuracy'][str(n)]:.1f}%" if str(n) in r["accuracy"] else "–"
                                  for n in lengths) + " |")
    Run(measure_load=False).write(RESULTS / "mamba_induction.md", "\n".join(lines) + "\n")
    plot(runs, lengths)
    print("\n".join(lines))


def plot(runs: list[dict], lengths: list[int]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 3.8))
    failed = 0
    for r in runs:
        ns = [n for n in lengths if str(n) in r["accuracy"]]
        accs = [100 * r["accuracy"][str(n)] for n in ns]
        if r["accuracy"][str(r["train_len"])] < 0.9:  # never learned the task: one grey legend entry
            ax.plot(ns, accs, color="lightgrey", lw=0.8, label=None if failed else "did not learn it at its training length")
            failed += 1
            continue
        line, = ax.plot(ns, accs, marker="o", label=f"{LABELS[r['model']]}, trained at {r['train_len']}")
        ax.axvline(r["train_len"], color=line.get_color(), ls=":", lw=0.8)
    ax.axhline(100 / 16, color="grey", ls="--", lw=0.8, label="chance")
    ax.set(xscale="log", xlabel="test sequence length", ylabel="accuracy (%)", ylim=(0, 102),
           title="Induction heads: train short, test longer (dotted: training length)")
    ax.set_xticks(lengths, [str(n) for n in lengths], rotation=45)
    ax.minorticks_off()
    ax.legend(fontsize=7, loc="center left")
    fig.tight_layout()
    fig.savefig(RESULTS / "mamba_induction.png", dpi=120)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=list(LABELS))
    p.add_argument("--report", action="store_true", help="write the table and plot from the saved runs")
    p.add_argument("--steps", type=int, default=4000, help="at most this many steps (stops at 99%% held out)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--max-len", type=int, default=16384)
    p.add_argument("--train-len", type=int, default=256)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--minutes", type=float, default=float("inf"), help="stop training after this long")
    p.add_argument("--tag", default="", help="suffix of the saved run's file name (to keep several runs)")
    run_or_report(p, run, report)


if __name__ == "__main__":
    main()
