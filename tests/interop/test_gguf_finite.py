"""A block-quantised GGUF matrix whose f16 scale is an infinity or a NaN is refused, naming the tensor.

``check_finite`` reads each block's scales as 16 bits in place; the independent reference is gguf-py's own
dequantisation of the same bytes: the matrix is refused exactly when ``gguf.quants.dequantize`` yields a value
that is not finite, and the count of bad scales equals numpy's ``isfinite`` over the scales copied out as
float16. Codes of all ones beside finite scales (the bytes an exponent test could confuse) pass.
"""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the optional extra 'gguf' is not installed")

from tformer.errors import CheckpointError  # noqa: E402
from tformer.interop.gguf_import import KEPT, SCALE_BYTES, check_finite  # noqa: E402
from tformer.interop.gguf_reader import GGML_TYPES  # noqa: E402

BYTES = {name: size for name, _, size in GGML_TYPES.values()}
ONE = np.float16(0.5).view(np.uint16)
BAD = {"inf": np.float16(np.inf).view(np.uint16), "-inf": np.float16(-np.inf).view(np.uint16),
       "nan": np.uint16(0x7E00), "signalling nan": np.uint16(0xFC01)}


class _File:
    """What check_finite reads of a GGUFFile: its path and one tensor's type."""

    def __init__(self, kind: str):
        self.path = "m.gguf"
        self.tensors = {"blk.0.ffn_up.weight": type("T", (), {"type": kind})()}


def blocks(kind: str, rows: int = 4, per_row: int = 3, seed: int = 0) -> np.ndarray:
    """Random codes with finite scales: ``(rows, per_row · BYTES)`` uint8."""
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (rows * per_row, BYTES[kind]), dtype=np.uint8)
    at = SCALE_BYTES.get(KEPT[kind], slice(0, 2))
    b[:, at] = np.full((b.shape[0], (at.stop - at.start) // 2), ONE, np.uint16).view(np.uint8)
    return b.reshape(rows, -1)


def refused(kind: str, a: np.ndarray) -> str | None:
    try:
        check_finite(_File(kind), "blk.0.ffn_up.weight", a, kept=True)
    except CheckpointError as e:
        return str(e)
    return None


@pytest.mark.parametrize("kind", sorted(KEPT))
def test_finite_blocks_pass_and_gguf_agrees(kind):
    a = blocks(kind)
    assert refused(kind, a) is None
    assert np.isfinite(gguf.quants.dequantize(a, gguf.GGMLQuantizationType[kind])).all()
    codes = a.copy().reshape(-1, BYTES[kind])
    at = SCALE_BYTES.get(KEPT[kind], slice(0, 2))
    keep = codes[:, at].copy()
    codes[:] = 0xFF
    codes[:, at] = keep                                      # every code byte all ones, the scales finite
    assert refused(kind, codes.reshape(a.shape)) is None


@pytest.mark.parametrize("kind", sorted(KEPT))
@pytest.mark.parametrize("bad", sorted(BAD))
def test_a_non_finite_scale_is_refused_as_gguf_reads_it(kind, bad):
    at = SCALE_BYTES.get(KEPT[kind], slice(0, 2))
    for slot in range((at.stop - at.start) // 2):            # d, and m / dmin where the format has one
        a = blocks(kind, seed=slot).reshape(-1, BYTES[kind])
        scales = a[:, at].copy().view(np.uint16)
        scales[[2, 7], slot] = BAD[bad]                       # two blocks of the 12
        a[:, at] = scales.view(np.uint8)
        a = a.reshape(4, -1)
        message = refused(kind, a)
        assert message is not None and "blk.0.ffn_up.weight" in message and len(message.splitlines()) == 1
        expected = int((~np.isfinite(scales.view(np.float16))).sum())
        assert f"holds {expected:,} NaN or infinite block scales" in message
        with np.errstate(invalid="ignore", over="ignore"):            # inf * 0 in gguf's arithmetic
            assert not np.isfinite(gguf.quants.dequantize(a, gguf.GGMLQuantizationType[kind])).all()
