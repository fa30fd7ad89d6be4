"""Block-quantised products (``qgemv.cpp``), built at first use, with the path picked from the CPU.

``y (M, N) = x (M, K) · Wᵀ + b`` for ``W`` in GGUF's Q8_0 / Q4_0 / Q4_1 blocks
(:mod:`tformer.quant.blocks`; Q5_0 / Q5_1 and the K-quants: :func:`kqgemm`): the activations are quantised to 8-bit blocks of 32, each block's
dot product is an integer, and one float multiply-add per block scales it. Paths (the same
arithmetic; they differ only in the float32 summation order):

- ``scalar``: portable C++, any CPU (ARM included);
- ``avx2``: AVX2 + FMA + F16C (``_mm256_maddubs_epi16``), e.g. AMD Zen 2/3, Intel since Haswell;
- ``avx512vnni``: AVX-512 BW/VL/DQ with VNNI (``_mm512_dpbusd_epi32``), e.g. Intel since Ice Lake, Zen 4.

The two SIMD paths read the weight repacked by :func:`tiles`: 8 (AVX2) or 16 (AVX-512) rows
interleaved by groups of four codes, so one broadcast of four activation codes and one
``maddubs``/``dpbusd`` advance 8 / 16 rows' dot products at once, and a block's 8 / 16 scales are one
``cvtph`` (tiles.h, "interleaved tiles"): the same bytes moved, made once per layer by BlockLinear
(Q5_0 / Q5_1 too: their fifth bits become byte masks, one per vector of codes).
Tiles made one after another lie end to end in shared arenas of 2 MB pages (a decode step streams
them from memory: fewer TLB misses, no 4 KB page breaks in the stream); the kernels prefetch 12 KB
ahead and take up to 4 activation rows per pass over a tile, so a batch or a prompt loads and
unpacks each weight block once per 4 rows.

:func:`path` is the fastest one this CPU runs (the last of ``paths()``), or
``$TFORMER_QGEMV_PATH`` when set (tests and A/B runs force each path with it; a path the CPU
cannot run is refused with a ConfigError). The library is compiled once per machine for the
baseline ISA, each SIMD path carrying its own ``target`` attribute, into ``$TFORMER_CACHE``
(default ``~/.cache/tformer``)/``qgemv-<hash>``. Where it cannot be built (no compiler,
``TFORMER_NO_EXTENSION=1``) :func:`qgemm` computes the same arithmetic with torch
(:func:`tformer.quant.blocks.dot`, far slower) and warns once.
"""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path

import torch

from tformer.errors import ConfigError
from tformer.extensions import build_once, compile_library
from tformer.quant import blocks, kblocks

Tensor = torch.Tensor
SOURCE = Path(__file__).with_name("qgemv.cpp")
TILES = SOURCE.with_name("tiles.h")           # activation rounding and tile kernels, shared with fused/layers.cpp
KQUANTS = SOURCE.with_name("kquants.h")       # the K-quant kernels, shared with fused/layers.cpp
KPREFILL = SOURCE.with_name("kprefill.h")     # their several-row products on widened tiles (included by kquants.h)
FILES = (SOURCE, TILES, KQUANTS, KPREFILL)    # what the built library depends on
PATHS = ("scalar", "avx2", "avx512vnni")      # index = the op's path number
FMT = {"q8_0": 0, "q4_0": 1, "q4_1": 2, "q4_k": 6, "q5_k": 7, "q6_k": 8, "q5_0": 9, "q5_1": 10}   # the ops' numbers
FORCED = "TFORMER_QGEMV_PATH"
STATUS: dict[str, str] = {}                    # "state": "built" | "unavailable: <why>"
_LOCK = threading.Lock()
_OP: list = []
_WARNED: list = []
_PATHS: list = []                              # paths() once computed: the CPU does not change


def _build():
    op = compile_library("tformer_qgemv", [SOURCE], list(FILES[1:]), "the block-quantised kernels")

    @torch.library.register_fake("tformer_qgemv::qgemm")
    def _shape(blocks, fmt, x, bias, path):             # lets torch.compile trace through the op
        return x.new_empty(x.shape[0], blocks.shape[0])

    @torch.library.register_fake("tformer_qgemv::kqgemm")
    def _k_shape(blocks, fmt, x, bias, path):
        return x.new_empty(x.shape[0], blocks.shape[0])

    @torch.library.register_fake("tformer_qgemv::qgemm_tiles")
    def _tiles_shape(tiles, fmt, n, x, bias, path):
        return x.new_empty(x.shape[0], n)
    return op


def load():
    """The ``torch.ops.tformer_qgemv`` namespace, building it the first time; ``None`` when it cannot
    be built here (the reason is in ``STATUS["state"]``)."""
    return build_once(_build, _OP, _LOCK, STATUS)


def paths() -> tuple[str, ...]:
    """The kernel paths this CPU runs, slowest first (``()`` when the library is not built)."""
    if not _PATHS:
        op = load()
        _PATHS.append(tuple(PATHS[i] for i in op.paths()) if op is not None else ())
    return _PATHS[0]


def path() -> str | None:
    """The path products use: ``$TFORMER_QGEMV_PATH`` if set, else the fastest this CPU runs;
    ``None`` when the library is not built (the torch fallback)."""
    here = paths()
    forced = os.environ.get(FORCED)
    if forced:
        if forced not in PATHS:
            raise ConfigError(f"{FORCED}={forced!r} is not a kernel path; choose one of {', '.join(PATHS)}.")
        if here and forced not in here:
            raise ConfigError(f"{FORCED}={forced!r} but this CPU runs only {', '.join(here)}: unset it or pick one of those.")
        return forced if here else None
    return here[-1] if here else None


TILE_ROWS = {"avx2": 8, "avx512vnni": 16}     # rows interleaved per tile by the SIMD paths (tiles.h)
TILED = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")   # the formats the SIMD paths read as tiles (blocks of 32)


def tiles(packed: Tensor, fmt: str, kernel_path: str, release: bool = False) -> Tensor | None:
    """``packed`` repacked for ``kernel_path`` (``TILE_ROWS`` rows interleaved, the same bytes moved:
    see tiles.h), or ``None`` for the scalar path and the torch fallback, which read the file layout.
    The tensor is a view into a shared arena of 2 MB pages, right after the tiles made before it;
    the arena is freed with the last tensor in it. ``release``: ``packed`` is a mapped file's pages,
    handed back as they are copied (only where :func:`tformer.quant.pages.mapped` says so)."""
    op = load()
    if op is None or kernel_path not in TILE_ROWS:
        return None
    return op.repack(packed, FMT[fmt], TILE_ROWS[kernel_path], release)


def _op_and_path(kernel_path: str | None):
    """The built library and the path to run (``kernel_path`` or :func:`path`), or ``(None, None)``: the
    torch fallback, after one warning per process."""
    op = load()
    if op is None:
        if not _WARNED:
            _WARNED.append(True)
            warnings.warn(f"tformer's block-quantised kernels are {STATUS.get('state')}; the block layers run a "
                          "slow torch implementation of the same arithmetic.", stacklevel=3)
        return None, None
    p = kernel_path or path()
    if p not in PATHS:
        raise ConfigError(f"unknown kernel path {p!r}; choose one of {', '.join(PATHS)}.")
    return op, p


def qgemm(packed: Tensor, fmt: str, x: Tensor, bias: Tensor | None = None, kernel_path: str | None = None,
          tiled: Tensor | None = None) -> Tensor:
    """``x (M, K) · Wᵀ + bias`` for ``packed (N, K/32 · bytes)`` ``fmt`` blocks: ``(M, N)`` in x's dtype.

    Args:
        kernel_path: force ``scalar`` / ``avx2`` / ``avx512vnni`` (default :func:`path`).
        bias: float32 ``(N,)`` or None.
        tiled: ``tiles(packed, fmt, kernel_path)`` made once by the caller (BlockLinear keeps it);
            without it the SIMD paths repack on every call (tests, one-off products).
    """
    blocks.check_format(fmt)
    op, p = _op_and_path(kernel_path)
    if op is None:
        return blocks.dot(packed, fmt, x, bias).to(x.dtype)
    if p in TILE_ROWS:
        return _tile_product(packed, fmt, x, bias, p, tiled)
    return op.qgemm(packed, FMT[fmt], x, bias, PATHS.index(p))


def _tile_product(packed: Tensor, fmt: str, x: Tensor, bias: Tensor | None, p: str, tiled: Tensor | None) -> Tensor:
    """The SIMD path ``p``'s product on tiles: ``tiled``, or made here for this one call."""
    t = tiled if tiled is not None else tiles(packed, fmt, p)
    return tile_product(t, fmt, packed.shape[0], x, bias, p)


def tile_product(tiled: Tensor, fmt: str, rows: int, x: Tensor, bias: Tensor | None, kernel_path: str) -> Tensor:
    """``x (M, K) · Wᵀ + bias`` -> ``(M, rows)`` from ``tiled`` (:func:`tiles` of W on ``kernel_path``) alone:
    what a layer that keeps its tiles runs, the file layout not read."""
    return load().qgemm_tiles(tiled, FMT[fmt], rows, x, bias, PATHS.index(kernel_path))


def kqgemm(packed: Tensor, fmt: str, x: Tensor, bias: Tensor | None = None, kernel_path: str | None = None,
           tiled: Tensor | None = None) -> Tensor:
    """``x (M, K) · Wᵀ + bias`` for ``packed`` K-quant super-blocks (q4_k, q5_k, q6_k; activations quantised to
    Q8_K, read as the file stores them) or Q5_0 / Q5_1 blocks (activations in 8-bit blocks of 32; on a SIMD path
    as :func:`tiles`, ``tiled`` or repacked here, else in the file layout) (:mod:`tformer.quant.kblocks`):
    ``(M, N)`` in x's dtype. ``kernel_path`` forces ``scalar`` / ``avx2`` / ``avx512vnni``. From 32 rows (a
    prompt) the SIMD paths widen each tile of K-quant weight rows on the fly (``kprefill.h``)."""
    kblocks.check_format(fmt)
    op, p = _op_and_path(kernel_path)
    if op is None:
        return kblocks.dot(packed, fmt, x, bias).to(x.dtype)
    if fmt in TILED and p in TILE_ROWS:
        return _tile_product(packed, fmt, x, bias, p, tiled)
    return op.kqgemm(packed, FMT[fmt], x, bias, PATHS.index(p))
