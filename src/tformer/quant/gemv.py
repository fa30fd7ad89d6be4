"""tformer's own one-row GEMV (``gemv.cpp``), built at first use, and torch's kernels when it cannot be.

``y = W x [* s] [+ b]`` for one row ``x (K,)`` and ``W (N, K)`` in float32, bfloat16, float16 or int8
(with per-row scales ``s``): the product every linear layer makes per decoded token. The loop widens
each weight to float32 in SIMD registers (AVX-512, 16 lanes, or AVX2 + FMA + F16C, 8 lanes: picked at
run time from the CPU's flags, :func:`path`; ``TFORMER_GEMV_PATH=avx2`` forces the narrower one on
an AVX-512 machine, for tests and A/B runs) and accumulates in float32, so its error against a
float64 reference is that of a float32 dot product of length K (about ``sqrt(K) · 2⁻²⁴`` relative to
``Σ|W_k x_k|``), plus the final rounding to ``x``'s dtype.

Build: ``torch.utils.cpp_extension.load`` compiles ``gemv.cpp`` (shipped inside the package) once
per machine into ``$TFORMER_CACHE`` (default ``~/.cache/tformer``)/``gemv-<hash>``; later
processes load the built library in milliseconds. When anything stops it (no C++ compiler, a CPU
without AVX2/FMA/F16C, ``TFORMER_NO_EXTENSION=1``), :func:`load` returns ``None``, says why once in
:data:`STATUS`, and the callers keep torch's kernels.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import threading
from pathlib import Path

import torch

Tensor = torch.Tensor
SOURCE = Path(__file__).with_name("gemv.cpp")
HEADER = SOURCE.with_name("float_rows.h")   # its row loops, shared with qgemv.cpp
STATUS: dict[str, str] = {}          # "state": "built" | "unavailable: <why>" (after the first load())
_LOCK = threading.Lock()
_OP: list = []                        # the loaded op, or [None] when it cannot be built
PATHS = ("auto", "avx2", "avx512")    # the op's path argument: index into this
FORCED = "TFORMER_GEMV_PATH"          # avx2 | avx512: use that path (if this CPU runs it) instead of the best


def cache_dir() -> Path:
    """Where built kernels and the kernel choices live: ``$TFORMER_CACHE`` or ``~/.cache/tformer``."""
    return Path(os.environ.get("TFORMER_CACHE") or Path.home() / ".cache" / "tformer")


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def _build():
    if os.environ.get("TFORMER_NO_EXTENSION"):
        raise RuntimeError("TFORMER_NO_EXTENSION is set")
    if not {"avx2", "fma", "f16c"} <= _cpu_flags():
        raise RuntimeError("this CPU has no AVX2 with FMA and F16C")
    from torch.utils import cpp_extension

    digest = hashlib.sha256(SOURCE.read_bytes() + HEADER.read_bytes() + torch.__version__.encode() + b"-fopenmp").hexdigest()[:12]
    build = cache_dir() / f"gemv-{digest}"
    build.mkdir(parents=True, exist_ok=True)
    if not (build / "tformer_gemv.so").exists():
        print(f"tformer: building the decode kernels once for this machine into {build} (about a minute)",
              file=sys.stderr, flush=True)
    cpp_extension.load(name="tformer_gemv", sources=[str(SOURCE)], build_directory=str(build),
                       # -fopenmp: at::parallel_for is an OpenMP pragma in a header, a serial loop without it;
                       # the library then shares the libgomp torch has already loaded (same soname)
                       # the baseline ISA: each loop carries its own target attribute (avx2 | avx512)
                       extra_cflags=["-O3", "-fopenmp"],
                       extra_ldflags=["-fopenmp"],
                       is_python_module=False, verbose=False)
    op = torch.ops.tformer_gemv
    if not op.paths():
        raise RuntimeError("the built kernel reports that this CPU runs neither of its paths")

    @torch.library.register_fake("tformer_gemv::gemv")
    def _shape(weight, x, scales=None, bias=None, path=0):      # lets torch.compile trace through the op
        return x.new_empty(weight.shape[0])
    return op


def path() -> str:
    """The SIMD path the loops take here: ``$TFORMER_GEMV_PATH`` if this CPU runs it, else the widest
    it runs (``avx512`` or ``avx2``); ``"none"`` without the extension."""
    op = build_once(_build, _OP, _LOCK, STATUS)
    if op is None:
        return "none"
    have = [PATHS[i] for i in op.paths()]
    forced = os.environ.get(FORCED)
    return forced if forced in have else have[-1]


def load():
    """The ``gemv(weight, x, scales=None, bias=None)`` op on :func:`path`, building it the first time;
    ``None`` when it cannot be built or run here (the reason is in ``STATUS["state"]``)."""
    op = build_once(_build, _OP, _LOCK, STATUS)
    return None if op is None else functools.partial(op.gemv, path=PATHS.index(path()))


def load_q4():
    """The int4 ``gemv_q4(packed, x, scales, offsets, bias=None)`` op (see :func:`pack_int4`) on
    :func:`path`, or ``None``."""
    op = build_once(_build, _OP, _LOCK, STATUS)
    return None if op is None else functools.partial(op.gemv_q4, path=PATHS.index(path()))


def pack_int4(q: Tensor) -> Tensor:
    """``q (N, K)`` integers in 0..15 -> ``(N, K/2)`` uint8 in gemv_q4's layout: per group of 32, byte j
    holds weight j (low nibble) and weight j + 16 (high nibble)."""
    N, K = q.shape
    g = q.to(torch.uint8).view(N, K // 32, 2, 16)                              # (N, G, half, 16)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(N, K // 2).contiguous()


def build_once(build, held: list, lock: threading.Lock, status: dict[str, str]):
    """``build()``'s result, built by the first caller only (``held`` keeps it, ``lock`` makes the
    other threads wait); ``None`` when building fails, with the reason in ``status["state"]``: any
    failure (no compiler, no ninja, a flag the CPU lacks) means the caller keeps its torch fallback."""
    if not held:
        with lock:
            if not held:
                try:
                    held.append(build())
                    status["state"] = "built"
                except Exception as e:  # noqa: BLE001  any failure means: keep torch's kernels
                    held.append(None)
                    status["state"] = f"unavailable: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return held[0]


def reference_q4(q: Tensor, scales: Tensor, offsets: Tensor, x: Tensor, bias: Tensor | None = None) -> Tensor:
    """``(q s + c) x + b`` in float64 for ``q (N, K)``, group scales/offsets ``(N, K/32)``: ``(N,)``."""
    w = q.double() * scales.double().repeat_interleave(32, 1) + offsets.double().repeat_interleave(32, 1)
    return reference(w, x, None, bias)


def reference(weight: Tensor, x: Tensor, scales: Tensor | None = None, bias: Tensor | None = None) -> Tensor:
    """The same product in float64 by torch (the tests' reference): ``(N,)`` float64."""
    y = weight.double() @ x.double()
    if scales is not None:
        y = y * scales.double()
    return y + bias.double() if bias is not None else y
