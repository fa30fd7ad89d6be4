"""Where one training step's time goes, op by op, and how much of it is overhead: nanoGPT's CPU configuration
(4L/4H/128, context 64, batch 12) with its recipe (``recipe=classic``, the default here) or tformer's
(``--recipe fast``), the trainer's own ``_train_step``.

    flock -w 900 /tmp/tformer-bench.lock timeout 300 env PYTHONPATH=src python benchmarks/training/step_ops.py
    (with ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 in front and --tag avx2
    for an AVX2-only CPU's software path)

1. Every op the step dispatches (aten's and tformer's kernels), each call timed by a ``TorchDispatchMode``
   around it: calls and milliseconds a step by op, over ``--steps`` steps after a warm-up. Why not
   torch.profiler: at this size it charged ~2.8 ms to each (768 x 128)(128 x 512) product inside a step that
   the dispatch mode times at 0.43 (0.34 alone); the mode's own cost shows as the gap between its steps'
   wall and the plain steps' (both reported).
2. The same code path at d = 8, 8 tokens, batch 1, where arithmetic is nothing: what a step costs in Python,
   dispatch, autograd and the optimizer's loops, by phase (forward, backward, clipping, AdamW, zero_grad),
   medians over ``--tiny-steps`` steps.

A measurement, not a comparison: no criterion. nanoGPT's own step beside this one (and the GEMMs alone) is
``cpu_kernels.py``'s section 5. Writes benchmarks/results/training/step_ops[-TAG].md.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # benchmarks/, for common/
from common.record import Run  # noqa: E402
from tformer.training.trainer import Trainer  # noqa: E402

SHAPE = dict(n_layers=4, n_heads=4, d_model=128, context_length=64, dropout=0.0, bias=False, batch_size=12,
               eval_interval=10**6, sample_tokens=0, progress=False, device="cpu")
TINY = {**SHAPE, "n_heads": 1, "d_model": 8, "context_length": 8, "batch_size": 1}
GEMMS = ("aten.mm.default", "aten.addmm.default", "aten.bmm.default")


class OpTimes(TorchDispatchMode):
    """Seconds spent in each op called under it (``times[op name]``: one entry a call)."""

    def __init__(self):
        super().__init__()
        self.times: dict[str, list[float]] = collections.defaultdict(list)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.times[str(func)].append(time.perf_counter() - t)
        return out


def trainer(settings: dict, data: str, threads: int, tmp: str, name: str) -> Trainer:
    return Trainer.create({**settings, "threads": threads, "data": data, "cache_dir": f"{tmp}/cache",
                           "out_dir": f"{tmp}/{name}"}, log=lambda m: None)


def steps(tr: Trainer, n: int) -> float:
    """Seconds of ``n`` training steps."""
    t = time.perf_counter()
    for _ in range(n):
        tr._train_step(1e-3)
        tr.step += 1
    return time.perf_counter() - t


def op_table(tr: Trainer, n: int, warm: int) -> tuple[dict[str, list[float]], float, float]:
    """(per-op call times over ``n`` timed steps, plain seconds a step, timed seconds a step)."""
    steps(tr, warm)
    plain = statistics.median(steps(tr, n) / n for _ in range(3))
    mode = OpTimes()
    with mode:
        timed = steps(tr, n) / n
    return mode.times, plain, timed


def phases(tr: Trainer, n: int) -> dict[str, float]:
    """Median seconds of each phase of a step, over ``n`` steps after 50 untimed ones: the phases of
    ``Loop._train_step`` (autocast as it sets it, its clipping), timed apart on one batch."""
    (_, batch, _), = list(tr.task.pieces(0, tr.dist))
    out: dict[str, list[float]] = {k: [] for k in ("forward", "backward", "clipping", "AdamW", "zero_grad")}
    for i in range(n + 50):
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=tr.dtype == torch.bfloat16):
            loss = tr.task.loss(tr.forward, batch)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if tr.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(tr.model.parameters(), tr.cfg.grad_clip, foreach=True)
        t3 = time.perf_counter()
        tr.optimizer.step()
        t4 = time.perf_counter()
        tr.optimizer.zero_grad(set_to_none=True)
        t5 = time.perf_counter()
        if i >= 50:
            for k, a, b in zip(out, (t0, t1, t2, t3, t4), (t1, t2, t3, t4, t5)):
                out[k].append(b - a)
    return {k: statistics.median(v) for k, v in out.items()}


def report(args, times: dict, plain: float, timed: float, tiny: dict[str, float]) -> str:
    n = args.steps
    per = sorted(((k, sum(v) / n, len(v) / n, statistics.median(v)) for k, v in times.items()), key=lambda r: -r[1])
    total = sum(r[1] for r in per)
    gemm = sum(r[1] for r in per if r[0] in GEMMS)
    lines = [f"# One `recipe={args.recipe}` training step, op by op ({args.precision}, 4L/4H/128, context 64, batch 12)", "",
             f"ATen's CPU capability: `{torch.backends.cpu.get_cpu_capability()}`; {args.threads} threads.", "",
             f"Plain steps: **{1e3 * plain:.2f} ms** a step (median of 3 runs of {n}); under the timing mode "
             f"{1e3 * timed:.2f} ms, of which the ops themselves {1e3 * total:.2f} ms. The GEMMs "
             f"(`mm`/`addmm`/`bmm`): **{1e3 * gemm:.2f} ms** ({100 * gemm / plain:.0f}% of a plain step); "
             f"everything else {1e3 * (plain - gemm):.2f} ms.", "",
             "| op | calls a step | ms a step | median µs a call | share of the ops' time |",
             "|---|---:|---:|---:|---:|"]
    for k, ms, calls, med in per[:args.rows]:
        lines.append(f"| `{k}` | {calls:.1f} | {1e3 * ms:.3f} | {1e6 * med:.1f} | {100 * ms / total:.1f}% |")
    rest = per[args.rows:]
    if rest:
        lines.append(f"| {len(rest)} other ops | {sum(r[2] for r in rest):.1f} | {1e3 * sum(r[1] for r in rest):.3f} "
                     f"| | {100 * sum(r[1] for r in rest) / total:.1f}% |")
    lines += ["", f"## The same code path at d = 8, 8 tokens, batch 1 (all overhead; medians of {args.tiny_steps} steps)",
              "", "| phase | ms |", "|---|---:|"]
    lines += [f"| {k} | {1e3 * v:.3f} |" for k, v in tiny.items()]
    lines += [f"| **step** | **{1e3 * sum(tiny.values()):.3f}** |", ""]
    return "\n".join(lines)


def main() -> int:
    shared = Path(__file__).resolve().parents[3] / "shared"
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=str(shared / "data" / "tinyshakespeare.txt"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--recipe", choices=("classic", "fast"), default="classic")
    ap.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    ap.add_argument("--warmup", type=int, default=50, help="untimed steps first (default 50)")
    ap.add_argument("--tiny-steps", type=int, default=250, help="steps of the d = 8 model (default 250)")
    ap.add_argument("--rows", type=int, default=25, help="ops listed one by one (default 25)")
    ap.add_argument("--tag", default="", help="suffix of the results file (e.g. avx2)")
    args = ap.parse_args()
    if not Path(args.data).is_file():
        print(f"step_ops: no corpus at {args.data}; pass --data PATH to tinyshakespeare.txt", file=sys.stderr)
        return 2
    run = Run()
    tmp = tempfile.mkdtemp(prefix="tformer-step-ops-")
    kind = {"precision": args.precision, "recipe": args.recipe}
    big = trainer({**SHAPE, **kind}, args.data, args.threads, tmp, "big")
    times, plain, timed = op_table(big, args.steps, args.warmup)
    small = trainer({**TINY, **kind}, args.data, args.threads, tmp, "tiny")
    tiny = phases(small, args.tiny_steps)
    text = report(args, times, plain, timed, tiny)
    path = run.write_result("training", "step_ops", args.tag, text)
    print(text)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
