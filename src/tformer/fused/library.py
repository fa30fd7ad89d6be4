"""The whole-layer kernels (``layers.cpp``) as ``torch.ops.tformer_fused``, built at first use.

``layers.cpp`` includes the block products' activation rounding and tile kernels
(``quant/tiles.h``), the K-quant kernels (``quant/kquants.h``), the float row loops (``quant/float_rows.h``) and e^x and the normal CDF in
registers (``ops/vec_exp.h``, ``ops/vec_erf.h``); the build's name hashes all six, so an edit of
any of them rebuilds it (:func:`tformer.extensions.compile_library`). Where it cannot be built (no
compiler, ``TFORMER_NO_EXTENSION=1``) :func:`load` gives ``None``, the reason is in
``STATUS["state"]``, and every model takes the module path.
"""

from __future__ import annotations

import threading
from pathlib import Path

from tformer.extensions import build_once, compile_library
from tformer.quant import gemv, qgemv

SOURCE = Path(__file__).with_name("layers.cpp")
OPS = SOURCE.parent.parent / "ops"
FILES = (SOURCE, qgemv.TILES, qgemv.KQUANTS, qgemv.KPREFILL, gemv.HEADER, OPS / "vec_exp.h", OPS / "vec_erf.h")   # what the built library depends on
STATUS: dict[str, str] = {}                    # "state": "built" | "unavailable: <why>"
_LOCK = threading.Lock()
_OP: list = []


def _build():
    return compile_library("tformer_fused", [SOURCE], list(FILES[1:]), "the whole-layer kernels")


def load():
    """The ``torch.ops.tformer_fused`` namespace (``layer``, ``layers``, ``product_ns``), building it
    the first time; ``None`` when it cannot be built here."""
    return build_once(_build, _OP, _LOCK, STATUS)
