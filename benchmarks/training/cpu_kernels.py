"""tformer's CPU training kernels against what they replace, in one process, alternated block by block.

    flock -w 900 /tmp/tformer-bench.lock timeout 300 env PYTHONPATH=src python benchmarks/training/cpu_kernels.py
    (with ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 in front for an
    AVX2-only CPU's software path, and --tag avx2)

1. Attention (``attention_backend=short``, ops/attention_cpu.cpp) against PyTorch's fused CPU kernel,
   forward + backward through autograd, causal, float32, q/k/v strided as split_heads makes them, at
   training shapes (batch, heads, length, head size).
2. The fast recipe's training step at 4L/128 (RoPE; fp32; ``Trainer._train_step``) with each kernel
   turned off in turn (the attention kernel, RoPE's one-pass rotation, ReLU²'s), each variant its own
   trainer on the same batches, toggled per block.

Criterion stated before the run: a kernel stays the default where it is not slower than what it
replaces (ratio <= 1.00 here); ``auto`` takes the attention kernel up to ``AUTO_MAX_KEYS`` keys.
Reported: medians over the rounds, and their ratio. Writes benchmarks/results/training/cpu_kernels[-TAG].md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # benchmarks/, for common/
from common.record import Run, results_dir  # noqa: E402
from tformer.ops import attention_cpu, relu2_cpu  # noqa: E402
from tformer.training.trainer import Trainer  # noqa: E402

SHAPES = [(12, 4, 64, 32), (16, 6, 128, 64), (4, 8, 512, 64), (2, 8, 1024, 64)]
STEP = dict(n_layers=4, n_heads=4, d_model=128, context_length=64, dropout=0.0, bias=False, batch_size=12,
            eval_interval=10**6, sample_tokens=0, progress=False, device="cpu", precision="fp32", positions="rope")
ISA_ENV = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")


def attention_times(shape, rounds: int) -> dict[str, float]:
    """Median seconds of one forward + backward, PyTorch's kernel and tformer's, alternated."""
    B, H, T, D = shape
    x = torch.randn(B, T, 3, H, D)
    q, k, v = (x[:, :, i].transpose(1, 2).detach().requires_grad_() for i in range(3))
    g = torch.randn(B, H, T, D)
    calls = {"torch": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
             "short": lambda: attention_cpu.short_attention(q, k, v, None, None, True, None, None, 0.0)}
    reps = max(3, int(2e8 / (B * H * T * T * D)))                   # about 0.1-0.3 s a block
    times = {name: [] for name in calls}
    for name, f in calls.items():                                   # warm-up
        f().backward(g)
    for _ in range(rounds):
        for name, f in calls.items():
            t = time.perf_counter()
            for _ in range(reps):
                f().backward(g)
            times[name].append((time.perf_counter() - t) / reps)
    return {name: statistics.median(v) for name, v in times.items()}


def step_times(data: str, threads: int, blocks: int, steps: int) -> dict[str, float]:
    """Median seconds of a training step with every kernel, and with each (then all) turned off."""
    serves, rotates = relu2_cpu.serves, attention_cpu.rotates
    variants = {"all kernels": (True, True, True), "no ReLU² kernel": (False, True, True),
                "no attention kernel": (True, False, True), "no one-pass RoPE": (True, True, False),
                "no kernel": (False, False, False)}
    tmp = tempfile.mkdtemp(prefix="tformer-kernels-")
    trainers = {}
    for name, (_, attention, _) in variants.items():
        tr = Trainer.create({**STEP, "threads": threads, "data": data, "cache_dir": f"{tmp}/cache",
                             "out_dir": f"{tmp}/{len(trainers)}"}, log=lambda m: None)
        if not attention:
            for m in tr.model.modules():
                if isinstance(getattr(m, "backend", None), str):
                    m.backend = "torch"
        trainers[name] = tr

    def use(name):
        relu2, _, rope = variants[name]
        relu2_cpu.serves = serves if relu2 else (lambda x: False)
        attention_cpu.rotates = rotates if rope else (lambda x, cos: False)

    times = {name: [] for name in variants}
    try:
        for name, tr in trainers.items():
            use(name)
            for _ in range(10):
                tr._train_step(1e-3)
                tr.step += 1
        for _ in range(blocks):
            for name, tr in trainers.items():
                use(name)
                t = time.perf_counter()
                for _ in range(steps):
                    tr._train_step(1e-3)
                    tr.step += 1
                times[name].append((time.perf_counter() - t) / steps)
    finally:
        relu2_cpu.serves, attention_cpu.rotates = serves, rotates
    return {name: statistics.median(v) for name, v in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    root = Path(__file__).resolve().parents[2]
    shared = next((c for c in (root.parent / "shared", root.parent.parent / "shared") if c.exists()), root.parent / "shared")
    ap.add_argument("--data", default=str(shared / "data" / "tinyshakespeare.txt"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="alternated rounds per attention shape (default 3)")
    ap.add_argument("--blocks", type=int, default=4, help="alternated blocks per step variant (default 4)")
    ap.add_argument("--steps", type=int, default=40, help="steps per block (default 40)")
    ap.add_argument("--tag", default="", help="suffix of the results file (e.g. avx2)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if attention_cpu.load() is None or relu2_cpu.load() is None:
        print(f"error: the kernels are not built here ({attention_cpu.STATUS.get('state')}; "
              f"{relu2_cpu.STATUS.get('state')})", file=sys.stderr)
        return 2
    run = Run()
    held = {k: os.environ[k] for k in ISA_ENV if k in os.environ}
    lines = ["# tformer's CPU training kernels against what they replace", "",
             f"{args.threads} threads, torch {torch.__version__}; ISA held: {held or 'no (the CPU own paths)'}. "
             "Criterion (before the run): a kernel stays where it is not slower than what it replaces.", "",
             f"## Attention, causal, float32: forward + backward ({args.rounds} alternated rounds, medians)", "",
             "| (batch, heads, length, head) | PyTorch's kernel (ms) | tformer's `short` (ms) | ratio | `auto` takes it |",
             "|---|---:|---:|---:|---|"]
    for shape in SHAPES:
        t = attention_times(shape, args.rounds)
        auto = "yes" if shape[2] <= attention_cpu.AUTO_MAX_KEYS else "no"
        lines.append(f"| {shape} | {1e3 * t['torch']:.2f} | {1e3 * t['short']:.2f} | {t['short'] / t['torch']:.2f}x | {auto} |")
        print(lines[-1], flush=True)
    steps = step_times(args.data, args.threads, args.blocks, args.steps)
    base = steps["all kernels"]
    lines += ["", f"## The fast recipe's step, 4L/128, fp32, RoPE ({args.blocks} alternated blocks of {args.steps} "
                  "steps, medians)", "", "| variant | ms/step | vs all kernels |", "|---|---:|---:|"]
    for name, v in steps.items():
        lines.append(f"| {name} | {1e3 * v:.1f} | {1e3 * (v - base):+.1f} ms |")
    name = "cpu_kernels" + (f"-{args.tag}" if args.tag else "")
    run.write(results_dir("training") / f"{name}.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
