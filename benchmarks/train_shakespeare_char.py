"""Training speed and quality on tinyshakespeare (char): tformer against nanoGPT, in the same run.

    flock /tmp/tformer-bench.lock env PYTHONPATH=src python benchmarks/train_shakespeare_char.py

nanoGPT's documented CPU configuration: 4 layers, 4 heads, d=128, context 64, batch 12, 2000
iterations, lr 1e-3 -> 1e-4 cosine over 2000, 100 warmup, dropout 0, no biases, AdamW beta2 0.99,
weight decay 0.1, clipping 1.0, evaluation every 250 iterations on 20 batches of each split.

When ``../shared/peers/nanoGPT`` (an unmodified nanoGPT snapshot) exists, the folder is copied to a
scratch directory, tinyshakespeare goes in as ``data/shakespeare_char/input.txt``, its own
``prepare.py`` runs (offline: it skips the download when input.txt exists), and then its own
``train.py`` runs with the CPU command from its README. Each round runs that command and then
``tformer train`` at the same configuration, each as a whole subprocess: the wall time is what a
user waits for (startup, evaluations, checkpoints included). Both use all the machine's cores
(tformer with ``threads`` set to ``os.cpu_count()``, as torch's default that nanoGPT keeps).
Reported: per-contender medians over the rounds, the ratio tformer / nanoGPT of the median walls,
the val loss each prints at iteration 2000, the CPU and how busy the machine was before and after.
When the nanoGPT folder is missing, tformer alone runs and no ratio is printed.

``--large-steps N`` adds nanoGPT's shakespeare_char configuration (6 layers, 6 heads, d=384, context
256, batch 64, dropout 0.2, which nanoGPT applies to the attention weights too, so tformer gets
``attn_dropout=0.2``): nanoGPT's train.py for N+2 iterations (its per-iteration times, the first two
dropped: the first includes its step-0 evaluation) alternated with N timed tformer steps in fp32 and
bf16 autocast; medians of s/iter and the ratios.
Writes benchmarks/results/train_shakespeare_char.md.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import busy_cores, cpu_name, load_note  # benchmarks/machine.py

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# The small configuration, in tformer's settings (nanoGPT's names in its command below).
SMALL = dict(n_layers=4, n_heads=4, d_model=128, context_length=64, dropout=0.0, bias=False, batch_size=12,
             lr=1e-3, min_lr=1e-4, warmup_steps=100, beta2=0.99, weight_decay=0.1, grad_clip=1.0,
             eval_interval=250, eval_batches=20, tokenizer="char", sample_tokens=0, progress=False, device="cpu")
NANOGPT_ARGS = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--eval_iters=20",
                "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4",
                "--n_embd=128", "--dropout=0.0"]
LARGE = dict(n_layers=6, n_heads=6, d_model=384, context_length=256, dropout=0.2, attn_dropout=0.2, bias=False,
             batch_size=64, lr=1e-3, beta2=0.99, weight_decay=0.1, grad_clip=1.0, eval_batches=1, tokenizer="char",
             sample_tokens=0, progress=False, device="cpu")
ITER = re.compile(r"iter (\d+): loss [\d.]+, time ([\d.]+)ms")
VAL = re.compile(r"step (\d+): train loss ([\d.]+), val loss ([\d.]+)")


def find_default(*rel: str) -> Path:
    """``../shared/<rel>`` next to the repository (or next to its parent, for a worktree)."""
    options = [ROOT.parent / "shared" / Path(*rel), ROOT.parent.parent / "shared" / Path(*rel)]
    return next((c for c in options if c.exists()), options[0])


def val_at(stdout: str, step: int) -> float:
    """The val loss a run printed at ``step`` (both programs print ``step N: train loss A, val loss B``)."""
    found = {int(m[1]): float(m[3]) for m in VAL.finditer(stdout)}
    if step not in found:
        raise RuntimeError(f"no val loss printed at step {step}; output ends:\n{stdout[-2000:]}")
    return found[step]


def timed(cmd: list[str], cwd: str) -> tuple[float, str]:
    """Wall seconds of one whole command, and its stdout (a failure raises with the output's tail)."""
    t = time.perf_counter()
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed ({p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}")
    return wall, p.stdout


def prepare_nanogpt(peer: Path, data: str, tmp: str) -> Path:
    """A scratch copy of the nanoGPT folder with tinyshakespeare prepared by its own prepare.py."""
    work = Path(tmp) / "nanoGPT"
    shutil.copytree(peer, work, ignore=shutil.ignore_patterns("out-*", "*.bin", "*.pkl", "input.txt"))
    ds = work / "data" / "shakespeare_char"
    shutil.copyfile(data, ds / "input.txt")
    timed([sys.executable, "prepare.py"], str(ds))
    return work


def tformer_cmd(data: str, out: str, steps: int, cache: str) -> list[str]:
    settings = {**SMALL, "max_steps": steps, "decay_steps": steps, "threads": os.cpu_count(), "cache_dir": cache}
    cmd = [sys.executable, "-m", "tformer", "train", "--data", data, "--out", out]
    for k, v in settings.items():
        cmd += ["--set", f"{k}={str(v).lower() if isinstance(v, bool) else v}"]
    return cmd


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=None, help="tinyshakespeare.txt (default: ../shared/data/)")
    ap.add_argument("--nanogpt", default=None, help="nanoGPT folder (default: ../shared/peers/nanoGPT)")
    ap.add_argument("--steps", type=int, default=2000, help="iterations of each run (default 2000)")
    ap.add_argument("--rounds", type=int, default=3, help="alternated rounds, nanoGPT then tformer (default 3)")
    ap.add_argument("--large-steps", type=int, default=0, help="timed steps of the 6L/384 config (0 = skip)")
    args = ap.parse_args()
    data = args.data or str(find_default("data", "tinyshakespeare.txt"))
    peer = Path(args.nanogpt) if args.nanogpt else find_default("peers", "nanoGPT")
    if not os.path.isfile(data):
        print(f"error: {data} not found; pass --data PATH to tinyshakespeare.txt", file=sys.stderr)
        return 2
    have_peer = (peer / "train.py").is_file()
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores", flush=True)
    if not have_peer:
        print(f"nanoGPT not found at {peer}: tformer alone runs, and no ratio is printed.", flush=True)
    tmp = tempfile.mkdtemp(prefix="tformer-bench-")
    nano_dir = prepare_nanogpt(peer, data, tmp) if have_peer else None
    nano_cmd = [sys.executable, "train.py", *NANOGPT_ARGS, f"--max_iters={args.steps}",
                f"--lr_decay_iters={args.steps}"]
    cache = f"{tmp}/cache"
    timed(tformer_cmd(data, f"{tmp}/warm", 1, cache) + ["--set", "eval_interval=1000"], str(ROOT))  # tokenise once,
    load = busy_cores()                                     # as nanoGPT's prepare.py does before its timing
    print(load_note(load), flush=True)
    runs = {"nanoGPT": [], "tformer": []}
    for r in range(args.rounds):
        if nano_dir is not None:
            shutil.rmtree(nano_dir / "out-shakespeare-char", ignore_errors=True)
            wall, out = timed(nano_cmd, str(nano_dir))
            runs["nanoGPT"].append((wall, val_at(out, args.steps)))
            print(f"round {r + 1}: nanoGPT {wall:.1f} s, val {runs['nanoGPT'][-1][1]:.4f}", flush=True)
        wall, out = timed(tformer_cmd(data, f"{tmp}/run{r}", args.steps, cache), str(ROOT))
        runs["tformer"].append((wall, val_at(out, args.steps)))
        print(f"round {r + 1}: tformer {wall:.1f} s, val {runs['tformer'][-1][1]:.4f}", flush=True)
    large = run_large(data, tmp, nano_dir, args.large_steps) if args.large_steps else {}
    load_end = busy_cores()
    print(load_note(load_end), flush=True)
    write_report(runs, args, load, load_end, " ".join(["python", "train.py", *nano_cmd[2:]]), large)
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


def run_large(data: str, tmp: str, nano_dir: Path | None, steps: int) -> dict[str, float]:
    """Median s/iter of the 6L/384 config: nanoGPT (one command, per-iteration times) and tformer fp32/bf16."""
    import torch

    from tformer.training.perf import bf16_supported
    from tformer.training.trainer import Trainer

    out = {}
    if nano_dir is not None:
        _, text = timed([sys.executable, "train.py", "config/train_shakespeare_char.py", "--device=cpu",
                         "--compile=False", "--eval_iters=1", "--log_interval=1", "--eval_interval=100000",
                         f"--max_iters={steps + 2}"], str(nano_dir))
        times = [float(m[2]) / 1e3 for m in ITER.finditer(text) if int(m[1]) >= 2]
        out["nanoGPT fp32"] = statistics.median(times)
    trs = {p: Trainer.create({**LARGE, "precision": p, "threads": os.cpu_count(), "data": data,
                              "out_dir": f"{tmp}/large-{p}", "cache_dir": f"{tmp}/cache"}, log=lambda m: None)
           for p in (["fp32", "bf16"] if bf16_supported() else ["fp32"])}
    torch.set_num_threads(os.cpu_count())
    times = {p: [] for p in trs}
    for tr in trs.values():
        tr._train_step(tr.cfg.lr)                                     # warm-up, not counted
    for _ in range(steps):
        for p, tr in trs.items():
            t = time.perf_counter()
            tr._train_step(tr.cfg.lr)
            times[p].append(time.perf_counter() - t)
    out.update({f"tformer {p}": statistics.median(ts) for p, ts in times.items()})
    print("large: " + ", ".join(f"{k} {v:.2f} s/iter" for k, v in out.items()), flush=True)
    return out


def write_report(runs: dict, args, load: float, load_end: float, nano_cmd: str, large: dict) -> None:
    med = {k: statistics.median(w for w, _ in v) for k, v in runs.items() if v}
    lines = [
        "# Training benchmark: tinyshakespeare, character level, tformer and nanoGPT in the same run",
        "",
        f"CPU: {cpu_name()}, {os.cpu_count()} cores. Before: {load_note(load)}; after: {load_note(load_end)}.",
        f"Configuration: 4 layers, 4 heads, d=128, context 64, batch 12, {args.steps} iterations, fp32, "
        f"{args.rounds} alternated rounds (nanoGPT then tformer), whole-command wall time.",
        f"nanoGPT command (its README's CPU run, in a scratch copy): `{nano_cmd}`.",
        "",
        f"| | wall, median (s) | walls (s) | val loss @{args.steps} |",
        "|---|---:|---|---|",
        *[f"| {k} | {med[k]:.1f} | {', '.join(f'{w:.1f}' for w, _ in v)} | {', '.join(f'{x:.4f}' for _, x in v)} |"
          for k, v in runs.items() if v],
    ]
    if "nanoGPT" in med:
        lines += ["", f"Ratio of median walls, tformer / nanoGPT: **{med['tformer'] / med['nanoGPT']:.2f}×** "
                      f"(below 1 = tformer faster; issue 17's goal: ≤ 0.6× with val loss ≤ 1.89)."]
    else:
        lines += ["", "nanoGPT was not found (../shared/peers/nanoGPT): no ratio."]
    if large:
        lines += ["", f"## Large config: 6L/6H/384, context 256, batch 64, dropout 0.2 (attention too), "
                      f"{args.large_steps} steps each", "", "| | s/iter (median) | speed vs nanoGPT fp32 |", "|---|---:|---:|"]
        ref = large.get("nanoGPT fp32")
        lines += [f"| {k} | {v:.2f} | {f'{ref / v:.2f}×' if ref else '-'} |" for k, v in large.items()]
    lines += ["", "Reproduce: `flock /tmp/tformer-bench.lock env PYTHONPATH=src .venv/bin/python "
                  f"benchmarks/train_shakespeare_char.py --rounds {args.rounds}"
                  + (f" --large-steps {args.large_steps}" if args.large_steps else "") + "`"]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "train_shakespeare_char.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
