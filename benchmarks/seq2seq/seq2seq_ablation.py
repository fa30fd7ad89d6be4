"""A small Vaswani et al. Table 3 on the built-in task: heads 1 / 4 / 8 at equal width, decoder and
encoder layers N = 1 / 2 / 4, post- vs pre-norm; the paper's rows (EN-DE newstest2013 dev BLEU,
base model N=6, d=512, h=8) beside ours.

    PYTHONPATH=src python benchmarks/seq2seq/seq2seq_ablation.py [--steps 1500] [--threads 1]

Every variant trains on the same pairs in the same order for the same steps; only the named
field changes from the base (d_model 64, h 4, N 2, post-norm). Writes
benchmarks/results/seq2seq/seq2seq_ablation.{md,json} (the JSON: ``{"rows": [...], "recorded": {...}}``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from tformer.machine import busy_cores
from tformer.training.seq2seq import Seq2SeqSettings, train
from tformer.training.seq2seq_data import number_pairs

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # benchmarks/, for common/
from common.record import Run, results_dir  # noqa: E402

RESULTS = results_dir("seq2seq")

# (row, change from the base, the paper's comparable rows of Table 3 with their dev BLEU; the paper's
# base is N=6, h=8, d=512, post-norm, 25.8)
VARIANTS = [
    ("base (h=4, N=2)", {}, "h=4: 25.5; N=2: 23.7"),
    ("(A) h=1", {"n_heads": 1}, "h=1: 24.9"),
    ("(A) h=8", {"n_heads": 8}, "h=8 (their base): 25.8"),
    ("(C) N=1", {"n_layers": 1, "encoder_layers": 1}, "no N=1 row (N=2: 23.7)"),
    ("(C) N=4", {"n_layers": 4, "encoder_layers": 4}, "N=4: 25.3"),
    ("pre-norm", {"norm_placement": "pre"}, "not in the paper (post-norm only)"),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--n-train", type=int, default=20000)
    ap.add_argument("--n-test", type=int, default=400)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    record = Run(busy_before=busy_cores(1.0))
    data = number_pairs(args.n_train, args.n_test, seed=0, max_digits=9)
    rows = []
    for name, change, paper in VARIANTS:
        s = Seq2SeqSettings(max_steps=args.steps, out_dir=f"runs/bench-ablation-{len(rows)}", eval_max=args.n_test,
                            progress=False, architecture=change)
        m = train(s, log=lambda msg: print(msg, file=sys.stderr, flush=True), data=data)
        rows.append({"row": name, "change": change, "paper": paper,
                     **{k: m[k] for k in ("bleu", "chrf", "exact", "parameters", "final_loss", "train_seconds")}})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    record.finish(busy_cores(1.0))
    record.write_json(RESULTS / "seq2seq_ablation.json", {"rows": rows})
    lines = ["# Vaswani et al. Table 3 style ablation on the built-in numbers task", "",
             f"{args.threads} thread(s); {args.steps} steps of 32 pairs; "
             f"base: d_model 64, d_ff 256, h 4, N 2 (encoder and decoder), post-norm, dropout 0.1, label smoothing "
             f"0.1; beam 4 on {args.n_test} held-out pairs.",
             "",
             "| row | parameters | final train loss | test BLEU | chrF | exact | paper (EN-DE dev BLEU) |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['row']} | {r['parameters']:,} | {r['final_loss']:.3f} | {r['bleu']:.1f} | {r['chrf']:.1f} | "
                     f"{r['exact']:.1%} | {r['paper']} |")
    record.write(RESULTS / "seq2seq_ablation.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
