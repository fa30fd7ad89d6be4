"""Attention memory and time vs sequence length: math, PyTorch's fused kernel, tformer flash.

1 batch, 8 heads, d_head 64, causal, fp32, forward + backward. Every (backend, n) point runs in its
own subprocess, which reports its peak resident memory (``getrusage(RUSAGE_SELF).ru_maxrss``, the
kernel's own high-water mark, which sees every allocation torch makes). A baseline subprocess that
allocates the same q, k, v and gradients and runs the same backend once at n = 128 (code, thread
pools) is subtracted, so the figure is the memory the length-n attention call itself needs. Math
points whose dense n x n tensors would not fit in the machine's available memory are skipped (and
marked so). Also at one length (default 8k): ALiBi and a sliding window with flash against math
with the dense bias / mask.

Run (only one benchmark at a time on the shared machine; the committed results used PASSIVE):
    flock /tmp/tformer-bench.lock env OMP_WAIT_POLICY=PASSIVE PYTHONPATH=$PWD/src python benchmarks/attention/attention.py

Writes benchmarks/results/attention/attention.md and attention.png (memory vs n, log-log).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # benchmarks/, for common/
from common.record import Run, load_note, results_dir  # noqa: E402

HEADS, D_HEAD = 8, 64


# ------------------------------------------------------------------------------ the worker side
def worker(backend: str, n: int, feature: str, repeats: int, heads: int = HEADS, baseline: bool = False) -> dict:
    """One point, in a fresh process: times (forward; forward + backward) and peak RSS.

    With ``baseline`` it only allocates q, k, v (+ grads) at length ``n`` and runs the backend once
    at n = 128 (which pages in its code and starts the thread pools), then reports the peak: the
    part of the peak that does not grow with n.
    """
    import torch

    from tformer import scaled_dot_product_attention
    from tformer.ops.alibi import alibi_slopes

    torch.manual_seed(0)
    kw: dict = {"causal": True, "backend": backend}
    if feature == "alibi":
        kw["alibi_slopes"] = alibi_slopes(heads)
    elif feature.startswith("window"):
        kw["window"] = int(feature.split("=")[1])

    def make(length):
        qkv = [torch.randn(1, heads, length, D_HEAD, requires_grad=True) for _ in range(3)]
        for t in qkv:  # the gradients belong to the baseline: every backend produces them
            t.grad = torch.zeros_like(t)
        return qkv

    def forward_backward(q, k, v):
        scaled_dot_product_attention(q, k, v, **kw).sum().backward()

    def forward(q, k, v):
        with torch.no_grad():
            scaled_dot_product_attention(q, k, v, **kw)

    forward_backward(*make(128))  # warm-up: code, thread pools, allocator
    q, k, v = make(n)
    result = {"backend": backend, "n": n, "feature": feature, "heads": heads}
    if not baseline:
        fb, fw = [], []
        for _ in range(repeats):  # alternate, so that a load spike hits both alike
            t0 = time.perf_counter()
            forward_backward(q, k, v)
            fb.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            forward(q, k, v)
            fw.append(time.perf_counter() - t0)
        result.update(fwd_bwd_s=statistics.median(fb), fwd_s=statistics.median(fw))
    result["peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return result


# ------------------------------------------------------------------------------ the parent side
def run_point(backend: str, n: int, feature: str, repeats: int, heads: int = HEADS) -> dict:
    """Measure one point, and subtract its baseline (same process setup without the length-n call)."""
    r = _spawn(backend, n, feature, repeats, heads, False)
    base = _spawn(backend, n, feature, 0, heads, True)
    if "error" not in r and "error" not in base:
        r["attn_mb"] = r["peak_mb"] - base["peak_mb"]
    return r


def _spawn(backend: str, n: int, feature: str, repeats: int, heads: int, baseline: bool) -> dict:
    cmd = [sys.executable, __file__, "--worker", backend, str(n), feature, str(repeats), str(heads), str(int(baseline))]
    proc = subprocess.run(cmd, capture_output=True, text=True)  # inherits OMP_WAIT_POLICY etc.
    if proc.returncode != 0:
        return {"backend": backend, "n": n, "feature": feature,
                "error": (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def available_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return float("inf")


def math_fits(n: int, heads: int = HEADS, n_dense: int = 8) -> bool:
    """The math backend holds about 7 fp32 (heads, n, n) tensors at its peak (measured at n = 4k);
    run it only if ``n_dense`` of them stay under half the memory available now (the machine is shared)."""
    return n_dense * heads * n * n * 4 / 2**20 < 0.5 * available_mb()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="1024,2048,4096,8192,16384,32768")
    parser.add_argument("--feature-length", type=int, default=8192, help="n for the ALiBi / window points")
    parser.add_argument("--feature-heads", type=int, default=2,
                        help="heads for the ALiBi / window points (math's dense 8-head bias at 8k needs ~15 GB)")
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--out", default=str(results_dir("attention") / "attention"))
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    run = Run()
    load = run.busy_before
    print(load_note(load))

    rows = []
    for n in lengths:
        repeats = 3 if n <= 4096 else 1
        for backend in ["math", "torch", "flash"]:
            if backend == "math" and not math_fits(n):
                rows.append({"backend": backend, "n": n, "feature": "causal", "skipped": True})
                print(f"n={n:6d} {backend:6s} skipped: dense n x n tensors would not fit")
                continue
            r = run_point(backend, n, "causal", repeats)
            rows.append(r)
            print(f"n={n:6d} {backend:6s} " + _fmt(r), flush=True)

    n = args.feature_length
    h = args.feature_heads
    for feature in ["alibi", f"window={args.window}"]:
        for backend in ["math", "flash"]:
            if backend == "math" and not math_fits(n, h):
                rows.append({"backend": backend, "n": n, "feature": feature, "skipped": True})
                print(f"n={n:6d} {backend:6s} {feature} skipped: dense tensors would not fit")
                continue
            r = run_point(backend, n, feature, 1, h)
            rows.append(r)
            print(f"n={n:6d} {backend:6s} {feature:12s} " + _fmt(r), flush=True)

    report(rows, lengths, run, Path(args.out))


def _fmt(r: dict) -> str:
    if "error" in r:
        return f"error: {r['error']}"
    return f"attn peak {r['attn_mb']:9.1f} MB   fwd {r['fwd_s']:8.3f} s   fwd+bwd {r['fwd_bwd_s']:8.3f} s"


def report(rows: list[dict], lengths: list[int], run: Run, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    by = {(r["backend"], r["n"], r["feature"]): r for r in rows}
    lines = [
        f"# Attention: memory and time vs n (1 batch, {HEADS} heads, d_head {D_HEAD}, causal, fp32, CPU)",
        "",
        "Memory: peak RSS of a subprocess per point minus that of a baseline subprocess that holds the same q, k, v "
        "and grads and ran the same backend once at n = 128 (code, thread pools): what the length-n call adds.",
        "",
        "| n | math MB | torch MB | flash MB | math fwd+bwd s | torch fwd+bwd s | flash fwd+bwd s | torch fwd s | flash fwd s | flash/torch fwd |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def cell(r, key, fmt):
        if r is None:
            return "-"
        if r.get("skipped"):
            return "skipped (would not fit)"
        if "error" in r:
            return "error"
        return fmt.format(r[key])

    for n in lengths:
        m, t, f = (by.get((b, n, "causal")) for b in ("math", "torch", "flash"))
        ratio = f"{f['fwd_s'] / t['fwd_s']:.2f}" if f and t and "fwd_s" in f and "fwd_s" in t else "-"
        lines.append(f"| {n} | {cell(m, 'attn_mb', '{:.0f}')} | {cell(t, 'attn_mb', '{:.0f}')} | "
                     f"{cell(f, 'attn_mb', '{:.0f}')} | {cell(m, 'fwd_bwd_s', '{:.2f}')} | "
                     f"{cell(t, 'fwd_bwd_s', '{:.2f}')} | {cell(f, 'fwd_bwd_s', '{:.2f}')} | "
                     f"{cell(t, 'fwd_s', '{:.3f}')} | {cell(f, 'fwd_s', '{:.3f}')} | {ratio} |")
    lines += ["", *summary(by, lengths)]
    feats = [r for r in rows if r["feature"] != "causal"]
    if feats:
        lines += ["", "Causal + ALiBi / sliding window (math gets the dense bias / mask; flash computes it per block):", "",
                  "| n | heads | feature | backend | MB | fwd s | fwd+bwd s |", "|---|---|---|---|---|---|---|"]
        for r in feats:
            lines.append(f"| {r['n']} | {r.get('heads', '-')} | {r['feature']} | {r['backend']} | {cell(r, 'attn_mb', '{:.0f}')} | "
                         f"{cell(r, 'fwd_s', '{:.3f}')} | {cell(r, 'fwd_bwd_s', '{:.2f}')} |")
    text = "\n".join(lines) + "\n"
    run.write(out.with_suffix(".md"), text)
    print(text)
    _plot(rows, out.with_suffix(".png"))


def summary(by: dict, lengths: list[int]) -> list[str]:
    """The issue's goals, computed from the measured points (extrapolations are labelled as such)."""
    out = []
    flash = [(n, by[("flash", n, "causal")]["attn_mb"]) for n in lengths
             if "attn_mb" in by.get(("flash", n, "causal"), {})]
    growth = [f"{b / a:.2f}" for (_, a), (_, b) in zip(flash, flash[1:])]
    if growth:
        out.append(f"- flash memory growth per doubling of n: {', '.join(growth)} (linear = 2, quadratic = 4).")
    maths = [(n, by[("math", n, "causal")]["attn_mb"]) for n in lengths
             if "attn_mb" in by.get(("math", n, "causal"), {})]
    for n, f_mb in flash:
        if n in dict(maths):
            out.append(f"- n={n}: flash / math peak memory = {f_mb / dict(maths)[n]:.3f} (both measured).")
        elif maths:
            n0, m0 = maths[-1]
            est = m0 * (n / n0) ** 2
            out.append(f"- n={n}: math not run (would not fit); extrapolated quadratically from n={n0}: "
                       f"~{est:.0f} MB, so flash / math ~ {f_mb / est:.4f} (extrapolated, not measured).")
    t, f = by.get(("torch", 4096, "causal"), {}), by.get(("flash", 4096, "causal"), {})
    if "fwd_s" in t and "fwd_s" in f:
        out.append(f"- n=4096 causal forward: flash / PyTorch fused = {f['fwd_s'] / t['fwd_s']:.2f}x "
                   f"(fwd+bwd {f['fwd_bwd_s'] / t['fwd_bwd_s']:.2f}x).")
    policy = os.environ.get("OMP_WAIT_POLICY", "unset (OpenMP default: spin, then sleep)")
    out.append(f"- Every subprocess ran with OMP_WAIT_POLICY={policy} (all contenders alike). Flash issues "
               "many small parallel ops per block, so its times depend on it on a shared CPU: PASSIVE helps "
               "when the cores are oversubscribed, hurts when they are not.")
    return out


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for backend, label in [("math", "math (dense)"), ("torch", "PyTorch fused"), ("flash", "tformer flash")]:
        pts = [(r["n"], r["attn_mb"]) for r in rows
               if r["backend"] == backend and r["feature"] == "causal" and "attn_mb" in r and r["attn_mb"] > 0]
        if pts:
            ax.loglog(*zip(*pts), marker="o", label=label, base=2)
    ax.set_xlabel("sequence length n")
    ax.set_ylabel("peak attention memory (MB, RSS above baseline)")
    ax.set_title(f"causal attention fwd+bwd, {HEADS} heads x d {D_HEAD}, CPU fp32")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        a = sys.argv
        print(json.dumps(worker(a[2], int(a[3]), a[4], int(a[5]), int(a[6]), bool(int(a[7])))))
    else:
        main()
