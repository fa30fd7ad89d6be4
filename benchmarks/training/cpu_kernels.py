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
3. nanoGPT's recipe (``recipe=classic``: exact GELU, learned positions) the same way, with the
   attention kernel, the exact GELU's kernel (its derivative saved by the forward) and every kernel
   turned off in turn; then with GPT-2's tanh GELU, with its kernel (ops/activation_cpu.cpp) turned off.
   And both GELU kernels alone against ATen's at 768 x 512.
4. Where ``auto`` stops: the fast recipe's step at 192 to 512 keys with ``auto``'s choice, the attention kernel
   forced on, and PyTorch's: the limit is set by whole steps (the kernel also saves the layout copies around
   attention, which the attention-alone timing in 1 does not see).
5. nanoGPT's own training step (``../shared/peers/nanoGPT/model.py``, where it is) against tformer's
   ``recipe=classic`` step, alternated in one process, beside the step's 51 GEMMs alone: the floor
   the same-recipe comparison shares.
6. The float32 GEMM libraries in this environment at those 51 products: MKL (what torch's ``mm`` and
   so both programs use), OpenBLAS (numpy's) and oneDNN. GEMMs are ~60% of an fp32 step, so which
   library is fastest on a CPU matters more than any kernel above; ``--only-gemm`` runs this alone
   (with ``OPENBLAS_CORETYPE=Haswell`` as well for the AVX2 emulation).

Criterion stated before the run: a kernel stays the default where it is not slower than what it
replaces (ratio <= 1.00 here); ``auto`` takes the attention kernel up to ``auto_max_keys()`` keys (by PyTorch's CPU capability).
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

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # benchmarks/, for common/
from common.record import Run  # noqa: E402
from tformer.ops import activation_cpu, attention_cpu  # noqa: E402
from tformer.training.trainer import Trainer  # noqa: E402

SHAPES = [(12, 4, 64, 32), (16, 6, 128, 64), (16, 6, 192, 64), (4, 8, 512, 64), (2, 8, 1024, 64)]
STEP = dict(n_layers=4, n_heads=4, d_model=128, context_length=64, dropout=0.0, bias=False, batch_size=12,
            eval_interval=10**6, sample_tokens=0, progress=False, device="cpu", precision="fp32", positions="rope")
CLASSIC = {**{k: v for k, v in STEP.items() if k != "positions"}, "recipe": "classic"}
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


KERNELS = ("relu2", "attention", "rope", "gelu_tanh", "gelu")


def without(*names: str) -> tuple[str, ...]:
    return tuple(k for k in KERNELS if k not in names)


FAST_VARIANTS = {"all kernels": KERNELS, "no ReLU² kernel": without("relu2"), "no attention kernel": without("attention"),
                 "no one-pass RoPE": without("rope"), "no kernel": ()}
CLASSIC_VARIANTS = {"all kernels": KERNELS, "no attention kernel": without("attention"),
                    "no exact-GELU kernel": without("gelu"), "no kernel": ()}
TANH_VARIANTS = {"all kernels": KERNELS, "no tanh-GELU kernel": without("gelu_tanh")}
# where ``auto`` should stop taking the attention kernel: its own choice against the kernel forced on and off
LIMIT_VARIANTS = {"all kernels": KERNELS, "attention kernel forced": (*KERNELS, "forced"),
                  "no attention kernel": without("attention")}
LIMIT_SHAPES = [(192, 128, 4, 12), (256, 128, 4, 12), (256, 256, 4, 12), (512, 128, 4, 6)]   # keys, width, heads, batch


def step_times(data: str, threads: int, blocks: int, steps: int, settings: dict,
               variants: dict[str, tuple[str, ...]]) -> dict[str, float]:
    """Median seconds of a training step under ``settings`` for each variant (the kernels it keeps on),
    each variant its own trainer on the same batches, toggled per block."""
    serves, rotates = activation_cpu.serves, attention_cpu.rotates
    tmp = tempfile.mkdtemp(prefix="tformer-kernels-")
    trainers = {}
    for name, on in variants.items():
        tr = Trainer.create({**settings, "threads": threads, "data": data, "cache_dir": f"{tmp}/cache",
                             "out_dir": f"{tmp}/{len(trainers)}"}, log=lambda m: None)
        if "attention" not in on or "forced" in on:
            for m in tr.model.modules():
                if isinstance(getattr(m, "backend", None), str):
                    m.backend = "short" if "forced" in on else "torch"
        trainers[name] = tr

    def use(name):
        on = variants[name]
        activation_cpu.serves = lambda x, kernel: kernel in on and serves(x, kernel)
        attention_cpu.rotates = rotates if "rope" in on else (lambda x, cos: False)

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
        activation_cpu.serves, attention_cpu.rotates = serves, rotates
    return {name: statistics.median(v) for name, v in times.items()}


def alternated(calls: dict, rounds: int, reps: int, warm: int) -> dict[str, float]:
    """Median seconds of one call of each of ``calls``, timed ``reps`` at a time, alternated over
    ``rounds`` (after ``warm`` untimed calls each)."""
    times = {name: [] for name in calls}
    for f in calls.values():
        for _ in range(warm):
            f()
    for _ in range(rounds):
        for name, f in calls.items():
            t = time.perf_counter()
            for _ in range(reps):
                f()
            times[name].append((time.perf_counter() - t) / reps)
    return {name: statistics.median(v) for name, v in times.items()}


def gelu_tanh_times(rounds: int) -> dict[str, float]:
    """Median seconds of the tanh GELU forward and backward at the 4L/128 MLP's activation (768 x 512),
    PyTorch's and the kernel's, alternated."""
    x, g = torch.randn(768, 512), torch.randn(768, 512)
    op = activation_cpu.load()
    calls = {"torch forward": lambda: F.gelu(x, approximate="tanh"), "kernel forward": lambda: op.gelu_tanh(x),
             "torch backward": lambda: torch.ops.aten.gelu_backward(g, x, approximate="tanh"),
             "kernel backward": lambda: op.gelu_tanh_backward(g, x)}
    return alternated(calls, rounds, reps=200, warm=20)


def gelu_exact_times(rounds: int) -> dict[str, float]:
    """Median seconds of the exact GELU's forward and backward at 768 x 512: ATen's (``F.gelu``, then
    ``gelu_backward`` from x) against the kernel's (value and derivative in one pass, then one multiply)."""
    x, g = torch.randn(768, 512), torch.randn(768, 512)
    op = activation_cpu.load()
    _, d = op.gelu_and_grad(x)
    calls = {"torch forward": lambda: F.gelu(x), "kernel forward": lambda: op.gelu_and_grad(x),
             "torch backward": lambda: torch.ops.aten.gelu_backward(g, x), "kernel backward": lambda: torch.mul(g, d)}
    return alternated(calls, rounds, reps=200, warm=20)


def step_gemms() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(a, b) of every product ``a @ b`` in a 4L/128 training step at batch 12 x 64 (768 rows): per layer
    the q/k/v, output, up and down projections, each forward, input gradient and weight gradient; then
    the head (65 tokens). 51 products, 3.66 GFLOP."""
    gemms = []
    for fan_in, fan_out, n in ((128, 384, 4), (128, 128, 4), (128, 512, 4), (512, 128, 4), (128, 65, 1)):
        gemms += [(torch.randn(768, fan_in), torch.randn(fan_in, fan_out)),       # forward
                  (torch.randn(768, fan_out), torch.randn(fan_out, fan_in)),      # input gradient
                  (torch.randn(fan_out, 768), torch.randn(768, fan_in))] * n      # weight gradient
    return gemms


def gemm_library_times(rounds: int, reps: int) -> dict[str, dict]:
    """Seconds of each distinct product of :func:`step_gemms`, and of the whole step's 51, through each
    float32 GEMM library in this environment: MKL (``torch.mm``, what every tformer and nanoGPT step
    uses), OpenBLAS (numpy's ``matmul``, into a preallocated output; its own threads, as many as the CPU
    has), oneDNN (``torch.ops.mkldnn._linear_pointwise``, the weight transposed once). Alternated per
    round, medians. Which library is fastest at these shapes depends on the CPU (MKL's own kernels on
    Intel; on AMD it is worth asking), which is why this is measured, not assumed."""
    gemms = step_gemms()
    shapes = sorted({(a.shape[0], a.shape[1], b.shape[1]) for a, b in gemms})
    data = {s: (torch.randn(s[0], s[1]), torch.randn(s[1], s[2])) for s in shapes}
    count = {s: sum(1 for a, b in gemms if (a.shape[0], a.shape[1], b.shape[1]) == s) for s in shapes}

    def calls(lib, a, b):
        if lib == "MKL (torch.mm)":
            return lambda: torch.mm(a, b)
        if lib == "OpenBLAS (numpy)":
            an, bn, out = a.numpy(), b.numpy(), np.empty((a.shape[0], b.shape[1]), np.float32)
            return lambda: np.matmul(an, bn, out=out)
        wt = b.t().contiguous()
        return lambda: torch.ops.mkldnn._linear_pointwise(a, wt, None, "none", [], "")

    libs = ["MKL (torch.mm)", "OpenBLAS (numpy)", "oneDNN (mkldnn linear)"]
    fns = {}
    for lib in libs:
        try:
            fns[lib] = {s: calls(lib, *data[s]) for s in shapes}
            for f in fns[lib].values():
                f()
        except (RuntimeError, AttributeError) as e:                # a torch built without oneDNN, say
            print(f"{lib}: not available here ({str(e).splitlines()[0]})", flush=True)
            fns.pop(lib, None)
    t = alternated({(lib, s): f for lib in fns for s, f in fns[lib].items()}, rounds, reps, warm=3)
    out = {}
    for lib in fns:
        per = {s: t[lib, s] for s in shapes}
        out[lib] = {"per_shape": per, "step": sum(per[s] * count[s] for s in shapes)}
    return {"libraries": out, "shapes": shapes, "count": count}


def nanogpt_step_times(data: str, threads: int, blocks: int, steps: int, nanogpt: Path) -> dict[str, float]:
    """Median seconds of nanoGPT's own training step (its ``model.py``, its AdamW groups, clipping at
    1.0) against tformer's ``recipe=classic`` step at 4L/128, alternated per block in one process, and
    of the step's 51 GEMMs alone at their shapes (hot in cache: a floor both programs share)."""
    sys.path.insert(0, str(nanogpt))
    from model import GPT, GPTConfig                                # nanoGPT's, unmodified

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, vocab_size=65, n_layer=4, n_head=4, n_embd=128, dropout=0.0, bias=False))
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.99), "cpu")
    x, y = torch.randint(0, 65, (12, 64)), torch.randint(0, 65, (12, 64))

    def nano():
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    tmp = tempfile.mkdtemp(prefix="tformer-kernels-")
    tr = Trainer.create({**CLASSIC, "threads": threads, "data": data, "cache_dir": f"{tmp}/cache",
                         "out_dir": f"{tmp}/o"}, log=lambda m: None)

    def ours():
        tr._train_step(1e-3)
        tr.step += 1

    gemms = step_gemms()

    def products():
        for a, b in gemms:
            torch.mm(a, b)

    calls = {"nanoGPT": nano, "tformer": ours, "the step's GEMMs alone": products}
    times = alternated(calls, blocks, reps=steps, warm=10)
    flops = sum(2 * a.shape[0] * a.shape[1] * b.shape[1] for a, b in gemms)
    return {**times, "gemm_flops": flops}


def gemm_lines(args) -> list[str]:
    """Section 6: :func:`gemm_library_times` as a table, per distinct product and for the whole step."""
    reps = max(10, 5 * args.steps)
    g = gemm_library_times(args.rounds * 2, reps)
    libs = list(g["libraries"])
    held = {k: os.environ[k] for k in (*ISA_ENV, "OPENBLAS_CORETYPE") if k in os.environ}
    lines = [f"## GEMM libraries at the step's shapes, float32, {args.threads} threads "
             f"({2 * args.rounds} alternated rounds of {reps} calls, medians; GFLOP/s; ISA held: {held or 'no'})", "",
             "| a @ b: (m x k) (k x n) | in a step | " + " | ".join(libs) + " |",
             "|---|---:|" + "---:|" * len(libs)]
    for s in g["shapes"]:
        flops = 2 * s[0] * s[1] * s[2]
        lines.append(f"| ({s[0]} x {s[1]}) ({s[1]} x {s[2]}) | {g['count'][s]} | "
                     + " | ".join(f"{flops / g['libraries'][lib]['per_shape'][s] / 1e9:.0f}" for lib in libs) + " |")
    base = g["libraries"][libs[0]]["step"]
    lines.append("| **the step's 51 products (ms)** | 51 | "
                 + " | ".join(f"**{1e3 * g['libraries'][lib]['step']:.2f}** ({g['libraries'][lib]['step'] / base:.2f}x)"
                              for lib in libs) + " |")
    print("\n".join(lines), flush=True)
    return lines


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
    ap.add_argument("--only-gemm", action="store_true",
                    help="only the GEMM libraries at the step's shapes (section 6; a minute), into cpu_kernels-gemm[-TAG].md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.only_gemm:
        run = Run()
        lines = ["# The float32 GEMM libraries at a 4L/128 training step's shapes", "", *gemm_lines(args)]
        run.write_result("training", "cpu_kernels-gemm", args.tag, "\n".join(lines) + "\n")
        print("\n".join(lines))
        return 0
    if attention_cpu.load() is None or activation_cpu.load() is None:
        print(f"error: the kernels are not built here ({attention_cpu.STATUS.get('state')}; "
              f"{activation_cpu.STATUS.get('state')})", file=sys.stderr)
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
        auto = "yes" if shape[2] <= attention_cpu.auto_max_keys() else "no"
        lines.append(f"| {shape} | {1e3 * t['torch']:.2f} | {1e3 * t['short']:.2f} | {t['short'] / t['torch']:.2f}x | {auto} |")
        print(lines[-1], flush=True)
    for title, base, times in (("GPT-2's tanh GELU", "`F.gelu`", gelu_tanh_times(args.rounds)),
                               ("The exact (erf) GELU", "ATen", gelu_exact_times(args.rounds))):
        lines += ["", f"## {title} at 768 x 512, float32 ({args.rounds} alternated rounds of 200 calls, medians)", "",
                  f"| pass | {base} (µs) | kernel (µs) | ratio |", "|---|---:|---:|---:|"]
        for p in ("forward", "backward"):
            lines.append(f"| {p} | {1e6 * times['torch ' + p]:.0f} | {1e6 * times['kernel ' + p]:.0f} | "
                         f"{times['kernel ' + p] / times['torch ' + p]:.2f}x |")
        print("\n".join(lines[-4:]), flush=True)
    for title, settings, variants in (("The fast recipe's step, 4L/128, fp32, RoPE", STEP, FAST_VARIANTS),
                                      ("nanoGPT's recipe (`recipe=classic`: exact GELU, learned positions), 4L/128, fp32",
                                       CLASSIC, CLASSIC_VARIANTS),
                                      ("The same with GPT-2's tanh GELU (`activation=gelu_tanh`)",
                                       {**CLASSIC, "activation": "gelu_tanh"}, TANH_VARIANTS)):
        steps = step_times(args.data, args.threads, args.blocks, args.steps, settings, variants)
        base = steps["all kernels"]
        lines += ["", f"## {title} ({args.blocks} alternated blocks of {args.steps} steps, medians)", "",
                  "| variant | ms/step | vs all kernels |", "|---|---:|---:|"]
        for name, v in steps.items():
            lines.append(f"| {name} | {1e3 * v:.1f} | {1e3 * (v - base):+.1f} ms |")
        print("\n".join(lines[-len(steps) - 4:]), flush=True)
    limit_steps = max(3, args.steps // 4)
    lines += ["", f"## Where `auto` stops taking the attention kernel: the fast recipe's step, 4 layers, fp32, "
                  f"`auto` (it takes the kernel up to {attention_cpu.auto_max_keys()} keys here) against the kernel "
                  f"forced on and off ({args.blocks} alternated blocks of {limit_steps} steps, medians)", "",
              "| keys | width / heads (head size) | batch | `auto` (ms) | kernel forced (ms) | PyTorch's (ms) | kernel / PyTorch's |",
              "|---:|---|---:|---:|---:|---:|---:|"]
    for keys, width, heads, batch in LIMIT_SHAPES:
        settings = {**STEP, "context_length": keys, "d_model": width, "n_heads": heads, "batch_size": batch}
        t = step_times(args.data, args.threads, args.blocks, limit_steps, settings, LIMIT_VARIANTS)
        short, torch_ = t["attention kernel forced"], t["no attention kernel"]
        lines.append(f"| {keys} | {width} / {heads} ({width // heads}) | {batch} | {1e3 * t['all kernels']:.1f} | "
                     f"{1e3 * short:.1f} | {1e3 * torch_:.1f} | {short / torch_:.3f}x |")
        print(lines[-1], flush=True)
    nanogpt = Path(args.data).parents[1] / "peers" / "nanoGPT"
    if (nanogpt / "model.py").exists():
        t = nanogpt_step_times(args.data, args.threads, args.blocks, args.steps, nanogpt)
        lines += ["", f"## nanoGPT's step against tformer's `recipe=classic` step, 4L/128, fp32, one process "
                      f"({args.blocks} alternated blocks of {args.steps} steps, medians)", "",
                  "| step | ms/step | vs nanoGPT's |", "|---|---:|---:|"]
        for name in ("nanoGPT", "tformer", "the step's GEMMs alone"):
            lines.append(f"| {name} | {1e3 * t[name]:.1f} | {t[name] / t['nanoGPT']:.2f}x |")
        lines += ["", f"The GEMMs alone: {t['gemm_flops'] / 1e9:.2f} GFLOP a step at "
                      f"{t['gemm_flops'] / t['the step' + chr(39) + 's GEMMs alone'] / 1e9:.0f} GFLOP/s, hot in cache; "
                      "both programs run the same products through the same library."]
        print("\n".join(lines[-7:]), flush=True)
    lines += ["", *gemm_lines(args)]
    run.write_result("training", "cpu_kernels", args.tag, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
