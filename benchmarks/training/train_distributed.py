"""One process with 2 threads against 2 processes with 1 thread each (DDP, FSDP) on this machine.

    flock /tmp/tformer-bench.lock env PYTHONPATH=src python benchmarks/training/train_distributed.py

The 6-layer, d=384, context-256 model (the shakespeare-char preset) on the built-in corpus, fp32,
the same global batch for every contender (batch_size 8 x grad_accum 2 = 16 sequences = 4096
tokens per step: one process runs two micro-batches of 8, each rank one piece of 8). Each run is a
real ``tformer train`` (torchrun for the ranks) of a few steps; tokens/s is the median over the
steps after the first of the per-step rates in metrics.jsonl. The contenders alternate, reversed
every other round; the table has each round's figure, the median, and the ratio to one process.

Memory, per rank: peak resident set (ru_maxrss, includes the ~0.3 GB of the torch libraries, so the
growth over the resident set at start-up is shown too) and the bytes of parameters and AdamW state
the rank holds at the end, counted from its tensors (a DTensor counts its local shard): FSDP's
shards hold 1/N of DDP's replica.

Writes benchmarks/results/training/train_distributed.md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
SETTINGS = dict(n_layers=6, n_heads=6, d_model=384, context_length=256, dropout=0.0, bias=False, batch_size=8,
                grad_accum=2, eval_batches=1, eval_interval=10_000, log_interval=1, sample_tokens=0,
                precision="fp32", progress=False, tokenizer="char")
CONTENDERS = {   # name: (launcher args or None for one process, extra settings)
    "1 process x 2 threads": (None, {"threads": 2}),
    "DDP, 2 processes x 1 thread": (["--nproc-per-node=2"], {"threads": 1, "strategy": "ddp"}),
    "FSDP, 2 processes x 1 thread": (["--nproc-per-node=2"], {"threads": 1, "strategy": "fsdp"}),
}


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def as_rank(stats_dir: str, argv: list[str]) -> int:
    """Run ``tformer <argv>`` in this process and write what it held and its peak memory."""
    import torch

    from tformer.cli import main
    from tformer.training.trainer import Trainer
    start_rss, held = _rss_mb(), {}
    fit = Trainer.fit

    def local_bytes(t) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    def counting_fit(self):
        out = fit(self)
        held["params_mb"] = sum(local_bytes(p) for p in self.model.parameters()) / 2**20
        held["optimizer_mb"] = sum(local_bytes(v) for s in self.optimizer.state.values() for v in s.values()
                                   if isinstance(v, torch.Tensor)) / 2**20
        return out

    Trainer.fit = counting_fit
    rc = main(argv)
    rank = int(os.environ.get("RANK", 0))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    Path(stats_dir, f"rank{rank}.json").write_text(json.dumps({"rank": rank, "start_rss_mb": start_rss,
                                                                "peak_rss_mb": peak, **held}))
    return rc


def run_one(name: str, steps: int, work: Path, cache: str) -> dict:
    launcher, extra = CONTENDERS[name]
    out, stats = Path(tempfile.mkdtemp(dir=work)), Path(tempfile.mkdtemp(dir=work))
    sets = [a for k, v in {**SETTINGS, **extra, "max_steps": steps, "cache_dir": cache}.items()
            for a in ("--set", f"{k}={v}")]
    entry = [str(HERE), "--as-rank", str(stats), "train", "--out", str(out / "run"), *sets]
    cmd = ([sys.executable, *entry] if launcher is None else
           [sys.executable, "-m", "torch.distributed.run", "--standalone", *launcher, *entry])
    env = {**os.environ, "OMP_NUM_THREADS": str(extra["threads"]), "GLOO_SOCKET_IFNAME": "lo"}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{name} failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    recs = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in recs if "tokens_per_s" in r and r["step"] > 1]
    ranks = [json.loads(p.read_text()) for p in sorted(stats.glob("rank*.json"))]
    return {"tokens_per_s": statistics.median(rates), "ranks": ranks}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5, help="training steps per run (the first is not timed)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of the alternating contenders")
    p.add_argument("--as-rank", metavar="DIR", help=argparse.SUPPRESS)
    args, rest = p.parse_known_args()
    if args.as_rank:
        sys.exit(as_rank(args.as_rank, rest))

    sys.path.insert(0, str(HERE.parents[1]))                  # benchmarks/, for common/
    from common.record import Run, results_dir
    from tformer.machine import busy_cores
    from tformer.training.data import load_corpus
    run = Run(measure_load=False)
    work = Path(tempfile.mkdtemp(prefix="tformer-dist-bench-"))
    cache = str(work / "cache")
    load_corpus(None, cache_dir=cache, log=lambda m: None)        # tokenise once, outside the timings
    run.busy_before = busy_cores(1.0)
    results: dict[str, list[dict]] = {name: [] for name in CONTENDERS}
    for rnd in range(args.rounds):
        order = list(CONTENDERS) if rnd % 2 == 0 else list(reversed(CONTENDERS))
        for name in order:
            res = run_one(name, args.steps, work, cache)
            results[name].append(res)
            print(f"round {rnd + 1}: {name}: {res['tokens_per_s']:,.0f} tokens/s", flush=True)
    run.finish()

    base = statistics.median(r["tokens_per_s"] for r in results["1 process x 2 threads"])
    lines = [
        "# Training on 2 processes vs 1 (benchmarks/training/train_distributed.py)", "",
        f"Model: 6 layers, 6 heads, d=384, context 256, fp32, no dropout; global batch 16 x 256 = 4096 tokens "
        f"per step; {args.steps} steps per run, the first not timed; {args.rounds} rounds, contenders alternating.", "",
        "| contender | tokens/s by round | median | x 1 process | peak RSS per rank (MB) | growth over start (MB) "
        "| parameters + AdamW state held per rank (MB) |",
        "|---|---|---:|---:|---|---|---|",
    ]
    for name, runs in results.items():
        med = statistics.median(r["tokens_per_s"] for r in runs)
        last = runs[-1]["ranks"]
        peak = " / ".join(f"{r['peak_rss_mb']:.0f}" for r in last)
        grow = " / ".join(f"{r['peak_rss_mb'] - r['start_rss_mb']:.0f}" for r in last)
        held = " / ".join(f"{r['params_mb']:.1f} + {r['optimizer_mb']:.1f}" for r in last)
        by_round = ", ".join(f"{r['tokens_per_s']:,.0f}" for r in runs)
        lines.append(f"| {name} | {by_round} | {med:,.0f} | {med / base:.2f} | {peak} | {grow} | {held} |")
    lines += ["", "Memory columns: the last round's run, one figure per rank (rank 0 / rank 1)."]
    text = "\n".join(lines) + "\n"
    print(text)
    run.write(results_dir("training") / "train_distributed.md", text)


if __name__ == "__main__":
    main()
