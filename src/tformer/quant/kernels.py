"""Which one-row (decode) linear kernel to use, chosen by measuring on the machine at hand, once.

The fastest kernel for ``y = W x`` with one row differs between CPUs and between torch builds: on one AVX-512
machine ``torch.mv`` beat ``F.linear`` for bfloat16, on another it lost
(docs/inference.md#lower-precision-and-the-kernels-behind-it). So no constant decides; :func:`choose` times
every candidate for a weight dtype on GPT-2-sized weights (768×3072 and 3072×768, eight of each, ~19-75 MB:
streamed from memory as in a real decode step), alternating them, and keeps the one with the smallest median.
The choice is stored in ``<cache_dir>/kernels.json`` under a key naming the CPU, torch's version, the thread
count and a digest of tformer's kernel sources, so each machine measures once (a fraction of a second per
dtype) and again after its kernels change; delete the file to measure again.

Candidates (all give the same numbers up to float32 summation order, which tests/quant/test_kernels.py
checks against a float64 reference):

- ``linear``: ``F.linear(x, W)`` (oneDNN/MKL inside torch);
- ``mm_t``: ``x @ Wᵀ`` with ``Wᵀ`` stored contiguous ``(K, N)`` (float32 only);
- ``mv``: ``torch.mv(W, x)``;
- ``int8pack``: ``aten._weight_int8pack_mm`` (int8 only);
- ``int4pack``: ``aten._weight_int4pack_mm_for_cpu`` (int4, groups of 32);
- ``ext``: tformer's own loops (``gemv.cpp``: ``gemv``, and ``gemv_q4`` for int4; AVX-512 or AVX2), when they build here.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from tformer.io import atomic_write
from tformer.machine import cpu_info
from tformer.extensions import cache_dir, source_digest
from tformer.quant import gemv, qgemv

Tensor = torch.Tensor
CANDIDATES = {"fp32": ("linear", "mm_t", "ext"), "bf16": ("linear", "mv", "ext"), "fp16": ("linear", "mv", "ext"),
              "int8": ("int8pack", "ext"), "int4": ("int4pack", "ext")}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.bfloat16,
          "int4": torch.bfloat16}
_CHOSEN: dict[str, str] = {}
FORCED = "TFORMER_DECODE_KERNEL"      # e.g. "ext" or "linear": skip the measurement (tests, A/B runs)


# what holds torch's kernels (oneDNN, ATen, MKL's GEMMs) to a narrower instruction set (an AVX2-only machine emulated on a
# wider one): a choice measured under them is stored apart, as one under a forced GEMV path
ISA_LIMITS = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")


def machine_key() -> str:
    """CPU model name, torch version, thread count and the kernels' sources: what a kernel choice
    depends on (a choice measured with an older ``gemv.cpp`` is not one for the new)."""
    forced = os.environ.get(gemv.FORCED)               # a forced GEMV path measures (and is stored) apart
    limits = [f"{k}={os.environ[k]}" for k in ISA_LIMITS if os.environ.get(k)]
    return f"{cpu_info().model} | torch {torch.__version__} | {torch.get_num_threads()} threads | kernels {_sources()}" + \
        (f" | gemv {forced}" if forced else "") + "".join(f" | {lim}" for lim in limits)


@functools.cache
def _sources() -> str:
    """The digest of every source a candidate runs (gemv.cpp, qgemv.cpp and their headers), read once."""
    return source_digest([*gemv.FILES, *qgemv.FILES])


def random_linear(n: int, k: int, g: torch.Generator) -> torch.nn.Linear:
    """A bias-free float32 ``nn.Linear(k, n)`` with weights of GPT-2's scale (std 0.02)."""
    lin = torch.nn.Linear(k, n, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) * 0.02)
    return lin


def available(kind: str) -> tuple[str, ...]:
    """The candidates for ``kind`` that can run here (``ext`` only when it builds)."""
    return tuple(k for k in CANDIDATES[kind] if k != "ext" or gemv.load() is not None)


@torch.inference_mode()
def measure(kind: str, make: Callable, copies: int = 8, rounds: int = 7, d: int = 768) -> dict[str, float]:
    """Median seconds per pass over ``copies`` pairs of (d×4d, 4d×d) weights, per candidate, alternated.

    ``make(kind, kernel, linear)`` builds the decode layer that is timed (the real one, with the kernel
    forced: :func:`tformer.quant.quantize.decode_layer`)."""
    g = torch.Generator().manual_seed(0)
    linears = [random_linear(n, k, g) for n, k in [(4 * d, d), (d, 4 * d)] * copies]
    x = {k: torch.randn(1, k, generator=g).to(DTYPES[kind]) for k in (d, 4 * d)}
    runs = {c: [make(kind, c, lin) for lin in linears] for c in available(kind)}
    times = {c: [] for c in runs}
    for r in range(rounds + 1):
        for c, fns in runs.items():
            t = time.perf_counter()
            for fn, lin in zip(fns, linears):
                fn(x[lin.in_features])
            if r:                                                            # round 0 warms up
                times[c].append(time.perf_counter() - t)
    return {c: statistics.median(v) for c, v in times.items()}


def _path():
    return cache_dir() / "kernels.json"


def choose(kind: str, make: Callable) -> str:
    """The fastest one-row kernel for ``kind`` (fp32, bf16, fp16, int8) here: measured once per machine
    and cached (in this process and in ``kernels.json``). ``$TFORMER_DECODE_KERNEL`` overrides it.
    ``make`` builds the layers to time (see :func:`measure`)."""
    forced = os.environ.get(FORCED)
    if forced:
        return forced if forced in available(kind) else available(kind)[0]
    return _chosen(kind, available(kind), lambda: measure(kind, make))


# --------------------------------------------------------------------------- several rows (prefill)
# A prompt's products: torch's kernel in the weight's dtype (``native``: MKL / oneDNN for float32; AMX,
# AVX512_BF16 or AVX512_FP16 for bf16 / fp16 where the CPU has them, an emulation where it does not);
# ``fp32``: widen the rows and the weight to float32 for torch's float32 GEMM and round the result back
# (the weight's widening is read-once work beside a product of M rows); or ``tiles``: tformer's own
# several-row kernel (gemv.cpp ``gemm``: a 4 x 3 register tile, the weight widened in registers, never
# copied; AVX2). Same numbers up to the summation order and the one final rounding; measured like the
# one-row choice, stored under "<kind>-prefill". Which wins depends on the CPU (on an AVX2-only one the
# tiles won at every type; with AMX the native bf16 product can), so it is measured, not fixed
# (docs/inference.md#speed-against-llamacpp-and-hf-in-the-same-run).
PREFILL = {"fp32": ("native", "tiles"), "bf16": ("native", "fp32", "tiles"), "fp16": ("native", "fp32", "tiles")}
PREFILL_ROWS = 64                     # rows of the timed product: a short prompt
PREFILL_FORCED = "TFORMER_PREFILL_KERNEL"


def prefill_available(kind: str) -> tuple[str, ...]:
    """The several-row candidates for ``kind`` that can run here (``tiles`` only when the extension builds)."""
    return tuple(c for c in PREFILL.get(kind, ("native",)) if c != "tiles" or gemv.load_gemm() is not None)


def prefill_product(kernel: str, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``x (M, K) @ weight (N, K)ᵀ + bias`` in ``x``'s dtype through ``kernel`` (see :data:`PREFILL`).
    ``tiles`` has no backward: callers under autograd take ``native``."""
    if kernel == "tiles":
        return gemv.load_gemm()(weight, x, None if bias is None else bias.float())
    if kernel == "fp32":
        y = torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())
        return y.to(x.dtype)
    return torch.nn.functional.linear(x, weight, bias)


@torch.inference_mode()
def measure_prefill(kind: str, rows: int = PREFILL_ROWS, copies: int = 2, rounds: int = 5,
                    d: int = 768) -> dict[str, float]:
    """Median seconds per pass of ``rows``-row products over ``copies`` pairs of (d×4d, 4d×d) weights
    in ``kind``'s dtype, per :data:`PREFILL` candidate, alternated."""
    g = torch.Generator().manual_seed(1)
    dtype = DTYPES[kind]
    weights = [random_linear(n, k, g).weight.detach().to(dtype) for n, k in [(4 * d, d), (d, 4 * d)] * copies]
    x = {k: torch.randn(rows, k, generator=g).to(dtype) for k in (d, 4 * d)}
    times = {c: [] for c in prefill_available(kind)}
    for r in range(rounds + 1):
        for c in times:
            t = time.perf_counter()
            for w in weights:
                prefill_product(c, x[w.shape[1]], w, None)
            if r:
                times[c].append(time.perf_counter() - t)
    return {c: statistics.median(v) for c, v in times.items()}


def choose_prefill(kind: str) -> str:
    """The fastest several-row product for ``kind`` (fp32, bf16, fp16) here, measured once per machine and
    cached beside the one-row choice; ``native`` for other kinds. ``$TFORMER_PREFILL_KERNEL``
    (native | fp32 | tiles) overrides it where that candidate runs."""
    have = prefill_available(kind)
    if len(have) < 2:
        return "native"
    forced = os.environ.get(PREFILL_FORCED)
    if forced in have:
        return forced
    return _chosen(f"{kind}-prefill", have, lambda: measure_prefill(kind))


def _stored() -> dict:
    """Every machine's stored choices (``kernels.json``), or ``{}`` when it is missing or unreadable."""
    try:
        return json.loads(_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _store(cached: dict) -> None:
    """Write ``cached`` as ``kernels.json`` atomically; a read-only home keeps the choices in this process only."""
    try:
        _path().parent.mkdir(parents=True, exist_ok=True)
        atomic_write(_path(), lambda tmp: Path(tmp).write_text(json.dumps(cached, indent=1), encoding="utf-8"))
    except OSError:
        pass


def _chosen(entry_kind: str, allowed, timings: Callable[[], dict[str, float]]) -> str:
    """The stored choice for ``entry_kind`` on this machine, or measure it (``timings()``) and store it.
    A stored choice whose candidates differ from ``allowed`` (a new kernel, or one that no longer builds)
    is measured again."""
    if entry_kind in _CHOSEN:
        return _CHOSEN[entry_kind]
    key = machine_key()
    entry = _stored().get(key, {}).get(entry_kind)
    if entry is None or entry.get("kernel") not in allowed or set(entry.get("seconds", ())) != set(allowed):
        times = timings()
        entry = {"kernel": min(times, key=times.get), "seconds": times}
        # read after measuring: timing the one-row layers builds DecodeLinears, which store their prefill
        # choice meanwhile; a copy read before the measurement would drop it
        cached = _stored()
        cached.setdefault(key, {})[entry_kind] = entry
        _store(cached)
    _CHOSEN[entry_kind] = entry["kernel"]
    return _CHOSEN[entry_kind]


def forget() -> None:
    """Drop this machine's stored choices (this key only), so the next :func:`choose` measures again:
    for a benchmark that must choose on a quiet machine."""
    _CHOSEN.clear()
    cached = _stored()
    if cached.pop(machine_key(), None) is not None:
        _store(cached)


def chosen() -> dict[str, dict]:
    """This machine's stored choices: kind -> {"kernel", "seconds" per candidate}."""
    return _stored().get(machine_key(), {})
