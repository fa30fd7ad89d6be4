"""Claim 7: FlashAttention's memory grows linearly with sequence length, and its output is exact
(Dao et al., 2022).

Memory: forward + backward of causal attention at lengths n, math backend (materialises n × n scores)
against tformer's flash backend (tiles, online softmax), in one subprocess started with glibc's mmap
threshold fixed so that freed buffers go back to the system. Before each point the kernel's
high-water mark of resident memory is reset (``/proc/self/clear_refs``); the figure is the peak minus
the resident memory just before the call, after a warm-up call (code pages, thread pools).
Exactness: flash against math in float64 (outputs and the gradients of q, k, v).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

from tformer.claims.base import Check, Claim
from tformer.claims.common import fmt, new_figure


def _rss(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise OSError(f"{field} not in /proc/self/status")


def _peak_bytes(fn) -> int:
    """Peak resident bytes that ``fn()`` adds, measured by the kernel's high-water mark."""
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")                                                  # reset VmHWM to the current RSS
    before = _rss("VmRSS")
    fn()
    return _rss("VmHWM") - before


def worker(config: dict) -> dict:
    """Runs in the subprocess: memory per (backend, n), and the float64 errors of flash against math."""
    import torch

    from tformer.ops.sdpa import scaled_dot_product_attention as attention

    torch.set_num_threads(1)
    h, d = config["heads"], config["d_head"]

    def step(backend, n, dtype=torch.float32):
        qkv = [torch.randn(1, h, n, d, dtype=dtype, requires_grad=True) for _ in range(3)]
        out = attention(*qkv, causal=True, backend=backend)
        out.backward(torch.ones_like(out))
        return out.detach(), [t.grad for t in qkv]

    for backend in ("math", "flash"):
        step(backend, 256)                                            # warm-up
    memory = {}
    for backend, lengths in (("math", config["math_lengths"]), ("flash", config["flash_lengths"])):
        memory[backend] = [_peak_bytes(lambda: step(backend, n)) for n in lengths]
    torch.manual_seed(0)
    qkv = [torch.randn(2, h, config["exact_n"], d, dtype=torch.float64) for _ in range(3)]
    results = {}
    for backend in ("math", "flash"):
        leaves = [t.clone().requires_grad_() for t in qkv]
        out = attention(*leaves, causal=True, backend=backend)
        out.backward(torch.cos(out.detach()))
        results[backend] = [out.detach()] + [t.grad for t in leaves]
    errors = [float((a - b).abs().max()) for a, b in zip(results["math"], results["flash"])]
    return {"memory": memory, "errors": dict(zip(("out", "dq", "dk", "dv"), errors))}


def run(config: dict, progress) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    code = f"import json, sys; from {__name__} import worker; print(json.dumps(worker(json.loads(sys.argv[1]))))"
    done = subprocess.run([sys.executable, "-c", code, json.dumps(config)], env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"the memory-measuring subprocess failed (exit {done.returncode}):\n{done.stderr}")
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    return {**measured, "math_lengths": config["math_lengths"], "flash_lengths": config["flash_lengths"]}


def slope(lengths: list[int], values: list[float]) -> float:
    """Least-squares slope of log(value) against log(n): 1 is linear, 2 quadratic."""
    xs, ys = [math.log(n) for n in lengths], [math.log(max(v, 1)) for v in values]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def _top_half(lengths, values):
    k = len(lengths) // 2
    return lengths[k:], values[k:]


def checks(m: dict) -> list[Check]:
    mem = m["memory"]
    s_flash = slope(*_top_half(m["flash_lengths"], mem["flash"]))
    s_math = slope(*_top_half(m["math_lengths"], mem["math"]))
    common = max(set(m["math_lengths"]) & set(m["flash_lengths"]))
    ratio = mem["math"][m["math_lengths"].index(common)] / max(mem["flash"][m["flash_lengths"].index(common)], 1)
    worst = max(m["errors"].values())
    return [
        Check("flash: log-log slope of peak memory vs n (upper half of the lengths) <= 1.3", s_flash <= 1.3,
              f"slope {fmt(s_flash)}"),
        Check("math: the same slope >= 1.7 (quadratic)", s_math >= 1.7, f"slope {fmt(s_math)}"),
        Check("at the longest common length, math needs >= 4 x flash's memory", ratio >= 4,
              f"{fmt(ratio)}x at n={common}"),
        Check("float64: flash's output and q/k/v gradients equal math's within 1e-10", worst <= 1e-10,
              f"max abs error {worst:.1e}"),
    ]


def rows(m: dict) -> list[tuple[str, str, str]]:
    mem = m["memory"]
    mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
    common = max(set(m["math_lengths"]) & set(m["flash_lengths"]))
    at_common = [mem[b][m[f"{b}_lengths"].index(common)] for b in ("math", "flash")]
    return [
        ("memory vs n (log-log slope): flash / math", "linear / quadratic (Fig. 3, right)",
         f"{fmt(slope(*_top_half(m['flash_lengths'], mem['flash'])))} / "
         f"{fmt(slope(*_top_half(m['math_lengths'], mem['math'])))}"),
        (f"peak memory at n = {common}: math / flash", "up to 20x less than exact attention baselines (§4.3)",
         f"{mib(at_common[0])} / {mib(at_common[1])}"),
        (f"flash at its longest n = {m['flash_lengths'][-1]}", "linear", mib(mem["flash"][-1])),
        ("max |flash - math|, float64, output and gradients", "exact (not an approximation)",
         f"{max(m['errors'].values()):.1e}"),
    ]


def plot(m: dict):
    fig, (a,) = new_figure(1)
    for backend in ("math", "flash"):
        a.plot(m[f"{backend}_lengths"], [b / 2**20 for b in m["memory"][backend]], "o-", label=backend)
    n0 = m["flash_lengths"][0]
    a.set(xscale="log", yscale="log", xlabel="sequence length n", ylabel="peak extra memory (MiB)",
          title="causal attention, forward + backward")
    a.legend(fontsize=8)
    a.text(n0, max(m["memory"]["math"]) / 2**20, "slope 2 = quadratic, 1 = linear", fontsize=8)
    return fig


CLAIM = Claim(
    name="flash-memory", order=7, title="FlashAttention: linear memory, exact output",
    sentence="Tiled attention with an online softmax needs memory linear in the sequence length, where "
             "standard attention's grows quadratically, and computes exactly the same result.",
    source="Dao et al. 2022, FlashAttention (NeurIPS), §3.1 (Theorem 1) and §4.3 with Fig. 3 (right: memory "
           "footprint vs sequence length)",
    published=[("§4.3, Fig. 3 right", "memory footprint grows linearly with sequence length; up to 20x more memory "
                                      "efficient than exact attention baselines"),
               ("§3.1, Theorem 1", "Algorithm 1 returns O = softmax(QKᵀ)V (exact), with O(N) additional memory")],
    sizes={"quick": {"heads": 4, "d_head": 32, "math_lengths": [128, 256, 512],
                     "flash_lengths": [128, 256, 512, 1024], "exact_n": 128},
           "full": {"heads": 8, "d_head": 64, "math_lengths": [512, 1024, 2048, 4096],
                    "flash_lengths": [512, 1024, 2048, 4096, 8192, 16384], "exact_n": 1000}},
    run=run, checks=checks, rows=rows, plot=plot,
    notes="CPU, fp32, batch 1, tformer's own flash kernel (the paper's is a CUDA kernel); peak resident memory "
          "of one process measured by the kernel, so allocator rounding is included. The slopes use the "
          "upper half of the lengths, where fixed costs no longer dominate.",
)
