"""Transformer vs Bahdanau vs an RNN encoder-decoder without attention, on the built-in task
(numbers in English words -> French words), BLEU by source length (Bahdanau et al. 2014, Fig. 2),
and alignment plots of one example from both attention models (Bahdanau et al. Fig. 3 style).

    PYTHONPATH=src python benchmarks/seq2seq/seq2seq_compare.py [--steps 1200] [--threads 1]

Every model sees the same training pairs in the same order, the same steps and batch size, and
the same width (d_model); the held-out test numbers never occur in training. Writes
benchmarks/results/seq2seq/seq2seq_compare.{md,json}, seq2seq_bleu_by_length.png, seq2seq_alignment.png.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from tformer.machine import busy_cores

from tformer.training.seq2seq import Seq2SeqSettings, load_run, scores_by_length, train
from tformer.training.seq2seq_data import BOS, number_pairs

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # benchmarks/, for common/
from common.record import Run, results_dir  # noqa: E402
RESULTS = results_dir("seq2seq")
EDGES = (10, 15, 20)          # source-length buckets (tokens): 1-10, 11-15, 16-20, >20
MODELS = [("transformer", "encoder-decoder"), ("Bahdanau (RNN + attention)", "bahdanau"),
          ("RNN, no attention", "rnn-encoder-decoder")]


def alignment(models: dict, tok, source: str, reference: str, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tformer.training.seq2seq import translate
    from tformer.training.seq2seq_data import make_batch

    fig, axes = plt.subplots(1, 2, figsize=(12, 6))
    outputs = []
    for ax, (name, model) in zip(axes, models.items()):
        output = translate(model, tok, [source], beams=4)[0]
        outputs.append(f"{name}: {output!r}")
        b = make_batch([(source, output)], tok)
        src, tgt = b["src"], b["tgt"]
        if hasattr(model, "cross_attention_maps"):
            w = model.cross_attention_maps(src, tgt)[-1][0].mean(0)            # last layer, mean over heads (T, S)
            title = f"{name}: last decoder layer's cross-attention, mean of heads"
        else:
            w = model.attention_weights(src, tgt)[0]                              # (T, S)
            title = f"{name}: additive attention"
        out_words = [tok.itos[i] for i in b["targets"][0].tolist() if i >= 0]
        ax.imshow(w.numpy(), cmap="gray_r", aspect="auto", vmin=0, vmax=1)
        ax.set_xticks(range(src.shape[1]), [tok.itos[i] for i in src[0].tolist()], rotation=60, ha="right")
        ax.set_yticks(range(len(out_words)), out_words)
        ax.set_title(title, fontsize=9)
    fig.suptitle(f"{source!r}\nreference {reference!r}\n" + "\n".join(outputs), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--n-train", type=int, default=20000)
    ap.add_argument("--n-test", type=int, default=400)
    ap.add_argument("--only", choices=[k for _, k in MODELS], help="train only this model (save its run), no tables")
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the settings' 1e-3)")
    ap.add_argument("--retable", action="store_true",
                    help="do not train: re-decode the test split with the runs saved by an earlier call")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    busy = busy_cores(1.0)
    record = Run(busy_before=busy)
    data = number_pairs(args.n_train, args.n_test, seed=0, max_digits=9)
    results, trained = {}, {}
    for label, kind in MODELS:
        if args.only and kind != args.only:
            continue
        s = Seq2SeqSettings(architecture={"model": kind}, max_steps=args.steps, out_dir=f"runs/bench-seq2seq-{kind}",
                            eval_max=args.n_test, progress=False, **({"lr": args.lr} if args.lr else {}))
        if args.retable:
            metrics = json.loads((Path(s.out_dir) / "metrics.json").read_text())
        else:
            metrics = train(s, log=lambda m: print(m, file=sys.stderr, flush=True), data=data)
        model, tok, saved = load_run(s.out_dir)
        rows = scores_by_length(model, tok, data[1], edges=EDGES, beams=4)
        results[label] = {"overall": {**{k: metrics[k] for k in ("bleu", "chrf", "exact", "parameters", "train_seconds",
                                                                 "steps", "final_loss")}, "lr": saved["lr"]},
                          "by_length": rows}
        trained[label] = (model, tok)
        print(label, json.dumps(results[label]), file=sys.stderr, flush=True)
    if args.only:
        return 0
    record.finish(busy_cores(1.0))
    record.write_json(RESULTS / "seq2seq_compare.json", results)
    write_table(results, args, record)
    plot(results)
    tok = trained["transformer"][1]
    src, ref = max(data[1], key=lambda p: len(tok.encode(p[0])) if len(tok.encode(p[0])) <= 16 else 0)
    alignment({"transformer": trained["transformer"][0], "Bahdanau": trained["Bahdanau (RNN + attention)"][0]},
              tok, src, ref, RESULTS / "seq2seq_alignment.png")
    return 0


def write_table(results: dict, args, record: Run) -> None:
    labels = list(results)
    buckets = [r["lengths"] for r in results[labels[0]]["by_length"]]
    lines = [f"# Transformer vs Bahdanau vs RNN without attention (built-in numbers task)", "",
             f"{args.threads} thread(s); {args.steps} steps of 32 pairs each; d_model 64; {args.n_train} training "
             f"pairs, {args.n_test} held-out test pairs; beam 4.", "",
             "| model | parameters | peak lr | final train loss | train s (busy) | test BLEU | chrF | exact match |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for label in labels:
        o = results[label]["overall"]
        lines.append(f"| {label} | {o['parameters']:,} | {o['lr']:g} | {o['final_loss']:.3f} | {o['train_seconds']:.0f} | "
                     f"{o['bleu']:.1f} | {o['chrf']:.1f} | {o['exact']:.1%} |")
    lines += ["", "BLEU by source length (tokens; n = test pairs in the bucket):", "",
              "| source length | n | " + " | ".join(labels) + " |", "|---|---:|" + "---:|" * len(labels)]
    for i, bucket in enumerate(buckets):
        n = results[labels[0]]["by_length"][i]["n"]
        lines.append(f"| {bucket} | {n} | " + " | ".join(
            f"{results[lab]['by_length'][i]['bleu']:.1f}" for lab in labels) + " |")
    record.write(RESULTS / "seq2seq_compare.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


def plot(results: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for label, r in results.items():
        rows = r["by_length"]
        ax.plot(range(len(rows)), [x["bleu"] for x in rows], marker="o", label=label)
    ax.set_xticks(range(len(rows)), [x["lengths"] for x in rows])
    ax.set_xlabel("source length (tokens)")
    ax.set_ylabel("test BLEU")
    ax.set_title("BLEU by source length (numbers, English -> French words)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "seq2seq_bleu_by_length.png", dpi=110)


if __name__ == "__main__":
    sys.exit(main())
