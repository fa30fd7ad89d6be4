"""A GGUF's tiled matrices hold the weights once: the file's pages a repack copied are handed back
(:mod:`tformer.quant.pages`), and only those.

- after the tiles of a Q8_0 matrix read from a mapped file are made, the mapping's resident bytes
  (``/proc/self/smaps``, the kernel's own count) fall to under 5% of the matrix (seen: a page or two);
- the bytes still read back as the file's (a released page is mapped again from the page cache): the
  layer dequantises to ``gguf.quants.dequantize`` of the file, and its products equal a copy's;
- memory that is not a registered mapping (a fresh copy) is never released: ``pages.mapped`` says no,
  and after its tiles are made it still holds the file's bytes;
- a JoinedLinear over row ranges of the file (a GGUF's q, k and v) does the same: its tiles made, the
  mapping's resident bytes fall likewise and no joined copy is kept; its products equal one matrix's.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="the optional extra 'gguf' is not installed")

from tformer.interop.gguf_reader import GGUFFile  # noqa: E402
from tformer.quant import pages, qgemv  # noqa: E402
from tformer.quant.block_linear import BlockLinear, JoinedLinear  # noqa: E402

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps is Linux's")
N, K = 2048, 1024                      # 2.1 MB of Q8_0 blocks: 530 pages


def resident(address: int) -> int:
    """Resident bytes of the mapping holding ``address``, as ``/proc/self/smaps`` counts them."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(a, 16) for a in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "Rss:":
            return int(line.split()[1]) * 1024
    raise AssertionError("no mapping holds the address")


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    w = np.random.default_rng(0).standard_normal((N, K)).astype(np.float32)
    p = tmp_path_factory.mktemp("pages") / "one.gguf"
    writer = gguf.GGUFWriter(str(p), "llama")
    q = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("w", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return p


def needs_tiles() -> None:
    kernel = qgemv.path()
    if kernel not in qgemv.TILE_ROWS:                              # no tiles made: nothing would be released anyway
        pytest.skip(f"kernel path {kernel} reads the file layout: no tiles")


def test_tiles_hand_back_the_file_pages_and_the_bytes_stay(path):
    needs_tiles()
    f = GGUFFile(path)
    blocks = torch.from_numpy(np.asarray(f.blocks("w")))
    assert pages.mapped(blocks)
    lin = BlockLinear(blocks, "q8_0")
    assert int(blocks.sum()) > 0                                   # every page read: resident
    before = resident(blocks.data_ptr())
    assert before >= blocks.numel()
    x = torch.randn(3, K)
    y = lin(x)
    assert resident(blocks.data_ptr()) < 0.05 * blocks.numel()     # the copy's source handed back
    expected = gguf.quants.dequantize(np.asarray(f.blocks("w")), gguf.GGMLQuantizationType.Q8_0)
    assert torch.equal(lin.dequantized(), torch.from_numpy(np.ascontiguousarray(expected, np.float32)))
    copy = BlockLinear(blocks.clone(), "q8_0")
    assert torch.equal(copy(x), y)


def test_memory_that_is_no_file_is_never_released(path):
    needs_tiles()
    f = GGUFFile(path)
    fresh = torch.from_numpy(np.array(f.blocks("w")))              # a copy: anonymous memory
    assert not pages.mapped(fresh)
    lin = BlockLinear(fresh, "q8_0")
    lin(torch.randn(2, K))
    assert torch.equal(lin.blocks, torch.from_numpy(np.asarray(f.blocks("w"))))


def test_joined_rows_are_tiled_from_the_file_and_no_joined_copy_is_kept(path):
    needs_tiles()
    f = GGUFFile(path)
    blocks = torch.from_numpy(np.asarray(f.blocks("w")))
    rows = [blocks[:1024], blocks[1024:1536], blocks[1536:]]          # q, k, v as a file stores them: apart
    lin = JoinedLinear(rows, "q8_0")
    assert int(blocks.sum()) > 0 and resident(blocks.data_ptr()) >= blocks.numel()
    x = torch.randn(3, K)
    y = lin(x)
    assert lin._joined is None                                     # the tiles are all it reads
    assert resident(blocks.data_ptr()) < 0.05 * blocks.numel()     # the file's pages handed back
    copy = BlockLinear(blocks.clone(), "q8_0")
    assert torch.equal(copy(x), y)
    assert torch.equal(lin.blocks, copy.blocks)                    # the rows still read as the file's
