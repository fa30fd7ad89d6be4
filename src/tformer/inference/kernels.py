"""Which one-row (decode) linear kernel to use, chosen by measuring on the machine at hand, once.

The fastest kernel for ``y = W x`` with one row differs between CPUs and between torch builds: on
one AVX-512 machine ``torch.mv`` beat ``F.linear`` for bfloat16 by 1.4×, on another it lost. So no
constant decides; :func:`choose` times every candidate for a weight dtype on GPT-2-sized weights
(768×3072 and 3072×768, eight of each, ~19-75 MB: streamed from memory as in a real decode step),
alternating them, and keeps the one with the smallest median. The choice is stored in
``<cache_dir>/kernels.json`` under a key naming the CPU, torch's version and the thread count, so
each machine measures once (~0.1-0.5 s per dtype); delete the file to measure again.

Candidates (all give the same numbers up to float32 summation order, which tests/test_kernels.py
checks against a float64 reference):

- ``linear``: ``F.linear(x, W)`` (oneDNN/MKL inside torch);
- ``mm_t``: ``x @ Wᵀ`` with ``Wᵀ`` stored contiguous ``(K, N)`` (float32 only);
- ``mv``: ``torch.mv(W, x)``;
- ``int8pack``: ``aten._weight_int8pack_mm`` (int8 only);
- ``int4pack``: ``aten._weight_int4pack_mm_for_cpu`` (int4, groups of 32);
- ``ext``: tformer's own AVX-512 loops (``gemv.cpp``: ``gemv``, and ``gemv_q4`` for int4), when they build here.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tformer.inference import gemv

Tensor = torch.Tensor
CANDIDATES = {"fp32": ("linear", "mm_t", "ext"), "bf16": ("linear", "mv", "ext"), "fp16": ("linear", "mv", "ext"),
              "int8": ("int8pack", "ext"), "int4": ("int4pack", "ext")}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.bfloat16,
          "int4": torch.bfloat16}
_CHOSEN: dict[str, str] = {}
FORCED = "TFORMER_DECODE_KERNEL"      # e.g. "ext" or "linear": skip the measurement (tests, A/B runs)


def machine_key() -> str:
    """CPU model name, torch version and thread count: what a kernel choice depends on."""
    name = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), name)
    except OSError:
        pass
    return f"{name} | torch {torch.__version__} | {torch.get_num_threads()} threads"


def runner(kind: str, kernel: str, w: Tensor, scales: Tensor | None = None):
    """A ``run(x (1, K)) -> (1, N)`` closure for one kernel on one weight ``w (N, K)`` (prepared here);
    for int4, ``w`` is ``q (N, K)`` in 0..15 and ``scales`` the ``(G, N, 2)`` scales and zeros."""
    if kind == "int4":
        if kernel == "ext":
            op, s = gemv.load_q4(), scales[..., 0].float().t().contiguous()
            packed, c = gemv.pack_int4(w), (scales[..., 1].float().t() - 8 * s).contiguous()
            return lambda x: op(packed, x[0], s, c, None).unsqueeze(0)
        n, pad = w.shape[0], -w.shape[0] % 16                              # torch's kernel: N a multiple of 16
        q = torch.cat([w.to(torch.int32), w.new_zeros(pad, w.shape[1], dtype=torch.int32)])
        sz = torch.cat([scales, scales.new_zeros(scales.shape[0], pad, 2)], 1)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, sz)[:, :n]
    if kernel == "ext":
        op = gemv.load()
        return lambda x: op(w, x[0], scales, None).unsqueeze(0)
    if kernel == "int8pack":
        s = scales.to(torch.bfloat16)
        return lambda x: torch.ops.aten._weight_int8pack_mm(x, w, s)
    if kernel == "mm_t":
        wt = w.t().contiguous()                                            # (K, N)
        return lambda x: torch.mm(x, wt)
    if kernel == "mv":
        return lambda x: torch.mv(w, x[0]).unsqueeze(0)
    return lambda x: F.linear(x, w)


def available(kind: str) -> tuple[str, ...]:
    """The candidates for ``kind`` that can run here (``ext`` only when it builds)."""
    return tuple(k for k in CANDIDATES[kind] if k != "ext" or gemv.load() is not None)


@torch.inference_mode()
def measure(kind: str, copies: int = 8, rounds: int = 7, d: int = 768) -> dict[str, float]:
    """Median seconds per pass over ``copies`` pairs of (d×4d, 4d×d) weights, per candidate, alternated."""
    g = torch.Generator().manual_seed(0)
    shapes = [(4 * d, d), (d, 4 * d)] * copies
    weights = []
    for n, k in shapes:
        if kind == "int8":
            weights.append((torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8), torch.rand(n) / 100))
        elif kind == "int4":
            weights.append((torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32),
                            torch.rand(k // 32, n, 2, generator=g).to(torch.bfloat16)))
        else:
            weights.append((torch.rand(n, k, generator=g).sub_(0.5).to(DTYPES[kind]), None))
    x = {k: torch.randn(1, k, generator=g).to(DTYPES[kind]) for k in (d, 4 * d)}
    runs = {c: [runner(kind, c, w, s) for w, s in weights] for c in available(kind)}
    times = {c: [] for c in runs}
    for r in range(rounds + 1):
        for c, fns in runs.items():
            t = time.perf_counter()
            for fn, (n, k) in zip(fns, shapes):
                fn(x[k])
            if r:                                                            # round 0 warms up
                times[c].append(time.perf_counter() - t)
    return {c: statistics.median(v) for c, v in times.items()}


def _path():
    return gemv.cache_dir() / "kernels.json"


def choose(kind: str) -> str:
    """The fastest one-row kernel for ``kind`` (fp32, bf16, fp16, int8) here: measured once per machine
    and cached (in this process and in ``kernels.json``). ``$TFORMER_DECODE_KERNEL`` overrides it."""
    forced = os.environ.get(FORCED)
    if forced:
        return forced if forced in available(kind) else available(kind)[0]
    if kind in _CHOSEN:
        return _CHOSEN[kind]
    key = machine_key()
    try:
        cached = json.loads(_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        cached = {}
    entry = cached.get(key, {}).get(kind)
    if entry is None or entry.get("kernel") not in available(kind):
        times = measure(kind)
        entry = {"kernel": min(times, key=times.get), "seconds": times}
        cached.setdefault(key, {})[kind] = entry
        try:
            from tformer.checkpoint import atomic_write
            _path().parent.mkdir(parents=True, exist_ok=True)
            atomic_write(_path(), lambda tmp: Path(tmp).write_text(json.dumps(cached, indent=1), encoding="utf-8"))
        except OSError:
            pass                                                             # a read-only home: measure per process
    _CHOSEN[kind] = entry["kernel"]
    return _CHOSEN[kind]


def forget() -> None:
    """Drop this machine's stored choices (this key only), so the next :func:`choose` measures again:
    for a benchmark that must choose on a quiet machine."""
    _CHOSEN.clear()
    try:
        cached = json.loads(_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    if cached.pop(machine_key(), None) is not None:
        from tformer.checkpoint import atomic_write
        atomic_write(_path(), lambda tmp: Path(tmp).write_text(json.dumps(cached, indent=1), encoding="utf-8"))


def chosen() -> dict[str, dict]:
    """This machine's stored choices: kind -> {"kernel", "seconds" per candidate}."""
    try:
        return json.loads(_path().read_text(encoding="utf-8")).get(machine_key(), {})
    except (OSError, ValueError):
        return {}
