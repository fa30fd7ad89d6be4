"""A GGUF whose kept blocks hold a NaN or infinite fp16 factor is refused at open, naming the tensor,
and one whose other bytes merely look like such a number is not (the check reads each block's factors
in place: Q4_K's d and dmin at bytes 0-3, Q6_K's d at bytes 208-209).

The file is ``tests/data/qwen2-tiny-q4_k_m.gguf`` (Q4_K and Q6_K, tests/data/README.md), one block's
bytes changed in a copy; the float import of the same copy is the reference for "not refused".
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("gguf", reason="the optional extra 'gguf' is not installed")

from tformer.errors import CheckpointError  # noqa: E402
from tformer.interop.gguf_import import load_gguf  # noqa: E402
from tformer.interop.gguf_reader import GGUFFile  # noqa: E402

FILE = Path(__file__).resolve().parents[1] / "data" / "qwen2-tiny-q4_k_m.gguf"
NAN, INF = b"\x00\x7e", b"\x00\x7c"                         # fp16 little-endian
# (tensor, its block bytes, the byte changed within block 3, the new bytes, refused)
CASES = [("blk.0.attn_k.weight", 144, 0, NAN, True),        # Q4_K d
         ("blk.0.attn_k.weight", 144, 2, INF, True),        # Q4_K dmin
         ("token_embd.weight", 210, 208, INF, True),        # Q6_K d
         ("blk.0.attn_k.weight", 144, 16, INF * 8, False),  # Q4_K codes that look like an infinity
         ("token_embd.weight", 210, 0, NAN * 8, False)]     # Q6_K low bits, likewise


@pytest.mark.parametrize("name,size,at,new,refused", CASES)
def test_a_non_finite_block_factor_is_refused(tmp_path, name, size, at, new, refused):
    path = tmp_path / "one.gguf"
    shutil.copy(FILE, path)
    offset = GGUFFile(FILE).tensors[name].offset + 3 * size + at
    with open(path, "r+b") as fh:
        fh.seek(offset)
        fh.write(new)
    if refused:
        with pytest.raises(CheckpointError, match=f"{name} holds 1 NaN or infinite block scales"):
            load_gguf(path, keep_quant=True)
    else:
        load_gguf(path, keep_quant=True)
        load_gguf(path)                                       # gguf's own dequantisation finds it finite too
