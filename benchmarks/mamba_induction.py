"""Induction heads length extrapolation (Mamba paper, Table 2 / Figure 2 right) at CPU size.

    PYTHONPATH=$PWD/src OMP_NUM_THREADS=1 python benchmarks/mamba_induction.py [--steps 600]

A 2-layer Mamba LM and a 2-layer attention LM with RoPE (both d=64) are trained at length 256 on
induction heads (vocab 16: a special token, a key after it, the special token again at the end:
predict the key), then tested at 256 ... 16384. Writes benchmarks/results/mamba_induction.{md,png}.
"""

from __future__ import annotations

import argparse
import subprocess
from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm

from mamba_tasks import accuracy, attention_config, induction_heads, mamba_config, train

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-len", type=int, default=16384)
    p.add_argument("--train-len", type=int, default=256)
    p.add_argument("--d", type=int, default=64)
    args = p.parse_args()
    lengths = [args.train_len * 2 ** k for k in range(16) if args.train_len * 2 ** k <= args.max_len]
    models = {"Mamba": mamba_config(17, d=args.d, context=lengths[-1]),
              "attention + RoPE": attention_config(17, d=args.d, context=lengths[-1])}
    table, info = {}, {}
    for name, config in models.items():
        model, losses, seconds = train(config, partial(induction_heads, T=args.train_len), args.steps, args.batch, desc=name)
        info[name] = (model.num_parameters(), losses[-1], seconds)
        table[name] = {}
        for n in tqdm(lengths, desc=f"{name} test"):
            count = 64 if n <= 4096 else 16
            ids, targets = induction_heads(count, n, g=torch.Generator().manual_seed(n))
            table[name][n] = accuracy(model, ids, targets, batch=16 if n <= 4096 else 4)
        print(name, table[name])
    cpu = subprocess.run("lscpu | grep 'Model name'", shell=True, capture_output=True, text=True).stdout
    lines = [f"# Induction heads: trained at length {args.train_len}, tested longer", "",
             f"2 layers, d={args.d} (Mamba: E={2 * args.d}, N=16, no feed-forward; attention: 4 heads, RoPE, SwiGLU); "
             f"AdamW 3e-3, {args.steps} steps of {args.batch} fresh sequences of length {args.train_len}, vocabulary 16. Accuracy of the "
             f"final prediction on 64 test sequences (16 at 8k and 16k). Paper: Mamba ~100% up to 2^20 = 1M "
             f"tokens; every attention variant (absolute, RoPE, xPos) falls to chance shortly past its training "
             f"length (2^8).", "",
             f"CPU: {cpu.split(':')[-1].strip()}, 1 thread, shared busy machine.", "",
             "| model | params | train loss | train s | " + " | ".join(str(n) for n in lengths) + " |",
             "|---|---:|---:|---:|" + "---:|" * len(lengths)]
    for name, accs in table.items():
        n_params, loss, sec = info[name]
        lines.append(f"| {name} | {n_params:,} | {loss:.3f} | {sec:.0f} | "
                     + " | ".join(f"{100 * accs[n]:.0f}%" for n in lengths) + " |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "mamba_induction.md").write_text("\n".join(lines) + "\n")
    plot(table, lengths)
    print("\n".join(lines))


def plot(table: dict, lengths: list[int]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, accs in table.items():
        ax.plot(lengths, [100 * accs[n] for n in lengths], marker="o", label=name)
    ax.axvline(lengths[0], color="grey", ls=":", label="training length")
    ax.axhline(100 / 16, color="grey", ls="--", lw=0.8, label="chance")
    ax.set(xscale="log", xlabel="test sequence length", ylabel="accuracy (%)", title="Induction heads extrapolation")
    ax.set_xticks(lengths, [str(n) for n in lengths], rotation=45)
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "mamba_induction.png", dpi=120)


if __name__ == "__main__":
    main()
