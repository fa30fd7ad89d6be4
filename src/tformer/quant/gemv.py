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
import os
import threading
from pathlib import Path

import torch

from tformer.extensions import build_once, compile_library

Tensor = torch.Tensor
SOURCE = Path(__file__).with_name("gemv.cpp")
HEADER = SOURCE.with_name("float_rows.h")   # its row loops, shared with fused/layers.cpp
FILES = (SOURCE, HEADER)                     # what the built library depends on
STATUS: dict[str, str] = {}          # "state": "built" | "unavailable: <why>" (after the first load())
_LOCK = threading.Lock()
_OP: list = []                        # the loaded op, or [None] when it cannot be built
PATHS = ("auto", "avx2", "avx512")    # the op's path argument: index into this
FORCED = "TFORMER_GEMV_PATH"          # avx2 | avx512: use that path (if this CPU runs it) instead of the best


def _build():
    # compiled for the baseline ISA: each loop carries its own target attribute (avx2 | avx512)
    op = compile_library("tformer_gemv", [SOURCE], [HEADER], "the decode kernels", needs={"avx2", "fma", "f16c"})
    if not op.paths():
        raise RuntimeError("the built kernel reports that this CPU runs neither of its paths")

    @torch.library.register_fake("tformer_gemv::gemv")
    def _shape(weight, x, scales=None, bias=None, path=0):      # lets torch.compile trace through the op
        return x.new_empty(weight.shape[0])

    @torch.library.register_fake("tformer_gemv::gemm")
    def _rows(weight, x, bias=None):
        return x.new_empty(x.shape[0], weight.shape[0])
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


def load_gemm():
    """The several-row ``gemm(weight, x, bias=None)`` op: ``y (M, N) = x (M, K) Wᵀ + b`` for ``W`` float32,
    bfloat16 or float16 as stored (widened in registers, a 4 × 3 register tile; AVX2 + FMA + F16C),
    ``x`` in any float dtype (computed in float32, returned in ``x``'s); ``None`` without the extension."""
    op = build_once(_build, _OP, _LOCK, STATUS)
    return None if op is None else op.gemm


def pack_int4(q: Tensor) -> Tensor:
    """``q (N, K)`` integers in 0..15 -> ``(N, K/2)`` uint8 in gemv_q4's layout: per group of 32, byte j
    holds weight j (low nibble) and weight j + 16 (high nibble)."""
    N, K = q.shape
    g = q.to(torch.uint8).view(N, K // 32, 2, 16)                              # (N, G, half, 16)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(N, K // 2).contiguous()


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
