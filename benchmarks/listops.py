"""A small Long Range Arena ListOps run on CPU: one 2-layer encoder per mixer, same data, same steps.

Data: tformer's generator (tformer.training.tasks.listops) with LRA's rules at CPU size (depth <= 5,
<= 5 arguments, 32..128 tokens instead of depth 10, 10 arguments, 500..2000 tokens). Model: encoder, 2 layers, d 64, 4 heads,
learned positions, mean pooling over real tokens, a linear 10-way head; AdamW, a fixed number of
steps, batch 32; test accuracy on 1000 held-out examples. Mixers: softmax attention (the
Transformer), Longformer (window 16 per side, global <cls>), BigBird (b 8, r 2), Performer (m 32),
Linformer (k 32). LRA Table 1 (Tay et al., 2021) for the ordering: Transformer 36.37, Longformer
35.63, BigBird 36.05, Performer 18.01, Linformer 35.70.

Run:  flock /tmp/tformer-bench.lock env PYTHONPATH=$PWD/src python benchmarks/listops.py
Writes benchmarks/results/attention/listops.md. (This script stays at the top of benchmarks/ while
its training loop moves into the library's one loop.)
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from common.record import Run, load_note, results_dir  # benchmarks/common/record.py
from tformer.training.tasks.listops import collate, generate, train_classifier

LRA = {"attention": 36.37, "longformer": 35.63, "bigbird": 36.05, "performer": 18.01, "linformer": 35.70}
OPTIONS = {"attention": {}, "longformer": {"window": 16, "global_positions": [0]},
           "bigbird": {"block_size": 8, "num_random_blocks": 2}, "performer": {"features": 32},
           "linformer": {"k": 32}}
N = 128


def run(mixer, train, test, steps, seed=0, keep=None):
    """Train one mixer's classifier with the library's training loop; (test accuracy %, last loss, seconds)."""
    model, acc, loss, elapsed = train_classifier(mixer, OPTIONS[mixer], train, test, steps, seed=seed, length=N)
    if keep is not None:
        keep[mixer] = model
    return acc, loss, elapsed


def approximation(model, test, n_examples=100):
    """On the trained softmax model's own q, k, v (each layer, real tokens only): FAVOR+'s relative
    error against exact attention for m random features (mean of 5 draws), and the share of each
    attention matrix's energy (sum of squared singular values) in its top k, the low-rank premise
    behind Linformer."""
    from tformer.ops.performer import favor_attention, gaussian_orthogonal, softmax_features

    inputs = []
    hooks = [b.attn.register_forward_pre_hook(lambda mod, args: inputs.append((mod, args[0])))
             for b in model.encoder.blocks]
    ids, mask, _ = collate(test[:n_examples], N)
    with torch.no_grad():
        model(ids, mask)
    for h in hooks:
        h.remove()
    perf, rank = {m: [] for m in (16, 32, 64, 128, 256)}, {k: [] for k in (4, 8, 16, 32)}
    g = torch.Generator().manual_seed(0)
    for mod, x in inputs:
        q, k, v = mod.qkv_proj(x).split(64, dim=-1)
        for row in range(ids.shape[0]):
            n = int(mask[row].sum())
            heads = [t[row, :n].view(n, 4, 16).transpose(0, 1) for t in (q, k, v)]   # (4, n, 16)
            att = torch.softmax(heads[0] @ heads[1].transpose(-1, -2) / 4.0, -1)     # (4, n, n)
            exact = att @ heads[2]
            for m in perf:
                for _ in range(5):
                    w = gaussian_orthogonal(m, 16, generator=g)
                    est = favor_attention(softmax_features(heads[0], w, is_query=True),
                                          softmax_features(heads[1], w, is_query=False), heads[2])
                    perf[m].append(((est - exact).norm() / exact.norm()).item())
            sv2 = torch.linalg.svdvals(att) ** 2                                   # (4, n)
            for kk in rank:
                rank[kk].append((sv2[:, :kk].sum(-1) / sv2.sum(-1)).mean().item())
    mean = lambda xs: sum(xs) / len(xs)                                           # noqa: E731
    return {m: mean(e) for m, e in perf.items()}, {kk: mean(e) for kk, e in rank.items()}


def main():
    from tqdm import tqdm

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--out", default=str(results_dir("attention") / "listops.md"))
    args = p.parse_args()
    kw = dict(max_depth=5, max_args=5, min_len=32, max_len=N)
    train, test = generate(8000, seed=1, **kw), generate(1000, seed=2, **kw)
    majority = max(sum(1 for _, y in test if y == c) for c in range(10)) / len(test) * 100
    record = Run()
    load = record.busy_before
    rows, models = [], {}
    for mixer in tqdm(list(OPTIONS), desc="mixers"):
        acc, loss, secs = run(mixer, train, test, args.steps, keep=models)
        rows.append(f"{mixer} | {acc:.1f} | {loss:.3f} | {secs:.0f} | {LRA[mixer]:.2f}")
    lines = ["# ListOps (generated, CPU-sized) per mixer", "",
             f"2-layer encoders, d 64, {args.steps} steps of batch 32, lengths 32..{N}, depth <= 5, 8000 train / "
             f"1000 test examples; majority class {majority:.1f} %. Machine at the start: {load_note(load)}; train "
             f"seconds are not a speed comparison (run beside other jobs, one mixer after another).", "",
             "mixer | test accuracy % | last train loss | train s | LRA Table 1 (full size)", "---|---|---|---|---",
             *rows]
    perf, rank = approximation(models["attention"], test)
    lines += ["", "On the trained softmax model's attention (2 layers, 100 test examples, real tokens only):", "",
              "Performer features m | " + " | ".join(str(m) for m in perf), "---|" + "---|" * len(perf),
              "relative error of FAVOR+ output vs exact (mean of 5 draws) | "
              + " | ".join(f"{e:.3f}" for e in perf.values()), "",
              "rank k | " + " | ".join(str(k) for k in rank), "---|" + "---|" * len(rank),
              "share of attention-matrix energy in the top k singular values | "
              + " | ".join(f"{e:.3f}" for e in rank.values())]
    record.write(args.out, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
