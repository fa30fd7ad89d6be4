"""Generation cost against context: per-token decode latency and inference-state memory of a Mamba LM
and a KV-cached transformer of about the same parameter count, from position 64 to 8192, in one run.

    PYTHONPATH=$PWD/src OMP_NUM_THREADS=1 python benchmarks/mamba/mamba_decode.py

At each position p both models prefill p random tokens into a fresh state (not timed), then decode
``--steps`` tokens one at a time; the fastest step is the latency (on a shared machine other
processes only ever add time, so the minimum is the best estimate of the cost itself; the median is
reported beside it). The two models alternate at each
position, token by token. Writes benchmarks/results/mamba/mamba_decode.{md,png}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from tformer.config import TransformerConfig
from tformer.models import build_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # benchmarks/, for common/
from common.record import Run, results_dir  # noqa: E402
RESULTS = results_dir("mamba")
POSITIONS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)


def models(d: int, vocab: int = 256, context: int = 1 << 14) -> dict:
    """Mamba with 2L layers against a transformer with L: a Mamba layer has ~6d² parameters, a
    transformer layer 12d² (4d² attention + 8d² MLP), as in the Mamba paper's comparisons."""
    mamba = TransformerConfig(vocab_size=vocab, d_model=d, n_layers=8, n_heads=1, mixer="mamba", ffn="none",
                              positions="none", norm="rmsnorm", bias=False, context_length=context)
    attention = TransformerConfig(vocab_size=vocab, d_model=d, n_layers=4, n_heads=4, positions="rope",
                                  norm="rmsnorm", ffn="mlp", bias=False, context_length=context,
                                  attention_backend="torch")
    return {"Mamba (8 layers)": mamba, "transformer + KV cache (4 layers)": attention}


@torch.inference_mode()
def decode_latency(built: dict, p: int, steps: int) -> dict:
    """{name: (fastest s, median s, state bytes)} per decoded token after a p-token prefill; the
    models take turns token by token, so both see the machine in the same state."""
    g = torch.Generator().manual_seed(p)
    ids = torch.randint(0, 256, (1, p + steps), generator=g)
    states = {}
    for name, model in built.items():
        states[name] = model.new_state(1, p + steps)
        model(ids[:, :p], state=states[name], last_only=True)
    times = {name: [] for name in built}
    for t in range(p, p + steps):
        for name, model in built.items():
            start = time.perf_counter()
            model(ids[:, t:t + 1], state=states[name], last_only=True)
            times[name].append(time.perf_counter() - start)
    return {n: (min(ts), statistics.median(ts), states[n].nbytes) for n, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--max-pos", type=int, default=POSITIONS[-1])
    args = ap.parse_args()
    positions = [p for p in POSITIONS if p <= args.max_pos]
    torch.manual_seed(0)
    built = {name: build_model(c).eval() for name, c in models(args.d).items()}
    record = Run()
    result = {name: {} for name in built}
    for p in tqdm(positions, desc="positions"):
        for name, r in decode_latency(built, p, args.steps).items():
            result[name][p] = r
    record.finish()
    names = list(built)
    lines = ["# Decode cost against context: Mamba's fixed state vs the transformer's KV cache", "",
             f"d={args.d}, vocab 256, fp32, batch 1; fastest (median) of {args.steps} decode steps after a "
             f"p-token prefill. "
             + "; ".join(f"{n}: {m.num_parameters():,} parameters" for n, m in built.items()) + ".", "",
             "| position | " + " | ".join(f"{n} ms/token | state KB" for n in names) + " | latency ratio (fastest) | state ratio |",
             "|---:|" + "---:|---:|" * len(names) + "---:|---:|"]
    for p in positions:
        (ta, ma, ba), (tb, mb, bb) = result[names[0]][p], result[names[1]][p]
        lines.append(f"| {p} | {1e3 * ta:.1f} ({1e3 * ma:.1f}) | {ba / 1024:.0f} | {1e3 * tb:.1f} ({1e3 * mb:.1f}) | "
                     f"{bb / 1024:.0f} | {tb / ta:.2f} | {bb / ba:.1f} |")
    lines += ["", "Ratios: transformer / Mamba. The KV cache is allocated for p + steps positions "
              "(what a request of that length holds)."]
    record.write(RESULTS / "mamba_decode.md", "\n".join(lines) + "\n")
    plot(result, positions)
    print("\n".join(lines))


def plot(result: dict, positions: list[int]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, by_pos in result.items():
        line, = ax1.plot(positions, [1e3 * by_pos[p][0] for p in positions], marker="o", label=f"{name}, fastest")
        ax1.plot(positions, [1e3 * by_pos[p][1] for p in positions], ls="--", marker=".", color=line.get_color(),
                 label=f"{name}, median")
        ax2.plot(positions, [by_pos[p][2] / 2**20 for p in positions], marker="o", label=name)
    ax1.set(xscale="log", xlabel="context position", ylabel="ms per decoded token", title="Decode latency (busy shared CPU)")
    ax2.set(xscale="log", yscale="log", xlabel="context position", ylabel="state MB (fp32, batch 1)",
            title="Inference state memory")
    for ax in (ax1, ax2):
        ax.set_xticks(positions, [str(p) for p in positions], rotation=45)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "mamba_decode.png", dpi=120)


if __name__ == "__main__":
    main()
