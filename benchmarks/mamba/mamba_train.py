"""Training throughput and validation loss after equal wall time: a Mamba LM against a transformer of
about the same parameter count, on the built-in stdlib corpus (character level), with tformer's Trainer.

    PYTHONPATH=$PWD/src OMP_NUM_THREADS=1 python benchmarks/mamba/mamba_train.py [--seconds 120]

The two runs take turns in slices of ``--slice`` seconds (each resumes its checkpoint), so both see
the machine in the same state on average. Writes benchmarks/results/mamba/mamba_train.{md,png}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from tformer.training.trainer import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # benchmarks/, for common/
from common.record import Run, results_dir  # noqa: E402
RESULTS = results_dir("mamba")
COMMON = dict(context_length=128, d_model=128, batch_size=8, lr=2e-3, min_lr=2e-4, warmup_steps=20,
              max_steps=100000, decay_steps=2000, eval_interval=25, eval_batches=8, sample_tokens=0,
              progress=False, threads=1, precision="fp32", log_interval=5, bias=False, norm="rmsnorm")
MODELS = {
    "Mamba (8 layers)": dict(n_layers=8, n_heads=1, mixer="mamba", ffn="none", positions="none"),
    "transformer (4 layers)": dict(n_layers=4, n_heads=4, positions="rope", ffn="mlp"),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=120, help="training wall time of each model")
    ap.add_argument("--slice", type=float, default=30, help="seconds per turn")
    args = ap.parse_args()
    record = Run()
    runs = Path(tempfile.mkdtemp(prefix="mamba-train-"))
    history: dict[str, list] = {name: [] for name in MODELS}
    params = {}
    for turn in range(int(args.seconds // args.slice)):
        for name, arch in MODELS.items():
            out = runs / name.split()[0]
            # time_limit counts the run's whole training time, resumes included: this turn ends at (turn+1) slices
            settings = {**COMMON, **arch, "out_dir": str(out), "time_limit": args.slice * (turn + 1)}
            trainer = Trainer.create(settings, resume=turn > 0, log=lambda m: None) if turn else \
                Trainer.create(settings, log=lambda m: None)
            params[name] = trainer.model.num_parameters()
            history[name] += trainer.fit()["history"]
    record.finish()
    lines = ["# Training throughput and loss after equal wall time: Mamba vs transformer", "",
             f"stdlib corpus, characters, context 128, batch 8, d=128, RMSNorm, fp32, AdamW 2e-3; each model "
             f"{args.seconds:g} s of training in turns of {args.slice:g} s.", "",
             "| model | parameters | steps | tokens/s (median) | val loss at the end | best val loss |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, hist in history.items():
        tok_s = [r["tokens_per_s"] for r in hist if "tokens_per_s" in r]
        evals = [r for r in hist if "val_loss" in r]
        lines.append(f"| {name} | {params[name]:,} | {evals[-1]['step']} | {statistics.median(tok_s) if tok_s else float('nan'):,.0f} | "
                     f"{evals[-1]['val_loss']:.3f} | {min(r['val_loss'] for r in evals):.3f} |")
    record.write(RESULTS / "mamba_train.md", "\n".join(lines) + "\n")
    plot(history)
    print("\n".join(lines))


def plot(history: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, hist in history.items():
        evals = [r for r in hist if "val_loss" in r]
        ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], marker=".", label=name)
    ax.set(xlabel="step", ylabel="validation loss", title="stdlib corpus, equal wall time")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "mamba_train.png", dpi=120)


if __name__ == "__main__":
    main()
