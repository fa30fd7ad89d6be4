"""Block-quantised kernels (qgemv.cpp): every path this CPU runs (scalar, avx2, avx512vnni) against a
float64 evaluation of the same quantised arithmetic, activation rounding included
(tformer.quant.blocks.reference), the run-time path choice and its override, and the torch fallback.

Tolerance: the integer block sums are exact and the codes are the reference's, so only float32
rounding separates a kernel from the reference: the product scale · sum per block and the sum over
G blocks, at most ~(G + 2) · 2⁻²⁴ of Σ_blocks |term| (3e-7 for G = 96, K = 3072). 1e-5 · Σ|term|
is asked, plus half an ulp of the output dtype (bfloat16 output: 2⁻⁸ relative).
"""

import os
import subprocess
import sys

import pytest
import torch

from tformer.errors import ConfigError
from tformer.quant import blocks, qgemv

pytestmark = pytest.mark.usefixtures("one_thread")
HALF_ULP = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}


def runnable(path):
    if qgemv.load() is None:
        pytest.skip(f"the block kernels are {qgemv.STATUS.get('state')}")
    if path not in qgemv.paths():
        pytest.skip(f"this CPU does not run the {path} path (it runs {', '.join(qgemv.paths())})")


def assert_matches_reference(y, packed, fmt, x, bias):
    ref = blocks.reference(packed, fmt, x.float(), bias)
    bound = 1e-5 * blocks.magnitude(packed, fmt, x.float()) + HALF_ULP[y.dtype] * ref.abs() + 1e-30
    err = (y.double() - ref).abs()
    assert bool((err <= bound).all()), float((err / bound).max())


@pytest.mark.parametrize("path", qgemv.PATHS)
@pytest.mark.parametrize("fmt", blocks.FORMATS)
# G = 1, 3 (odd: the 512-bit path's 256-bit tail), 24 and 96; N not a multiple of anything; M = 1 (decode) and 5
@pytest.mark.parametrize("n, k, m", [(7, 32, 1), (37, 96, 1), (13, 768, 5), (50, 3072, 1), (3, 96, 5)])
def test_every_path_matches_float64_reference(path, fmt, n, k, m):
    runnable(path)
    g = torch.Generator().manual_seed(n * k + m)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 0.1
    x = torch.randn(m, k, generator=g) * 3
    x[0, :32] = 0                                                 # a zero activation block (scale 0)
    bias = torch.randn(n, generator=g)
    packed = blocks.quantize(w, fmt)
    y = qgemv.qgemm(packed, fmt, x, bias, path)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert_matches_reference(y, packed, fmt, x, bias)
    assert_matches_reference(qgemv.qgemm(packed, fmt, x, None, path), packed, fmt, x, None)
    yb = qgemv.qgemm(packed, fmt, x.bfloat16(), bias, path)
    assert yb.dtype == torch.bfloat16
    assert_matches_reference(yb, packed, fmt, x.bfloat16(), bias)


@pytest.mark.parametrize("path", qgemv.PATHS)
def test_extreme_codes_do_not_saturate(path):
    """Q8_0 codes of -128 (valid in a GGUF file, never written by ggml's quantiser) and 127 against
    activations all at ±127: maddubs sums pairs 128·127 + 128·127 = 32512 < 2¹⁵, no saturation."""
    runnable(path)
    g = torch.Generator().manual_seed(1)
    n, k = 6, 96
    codes = torch.where(torch.rand(n, k, generator=g) < 0.5, -128, 127).to(torch.int8)
    scale = torch.full((n, k // 32, 1), 0.01).half().view(torch.uint8).view(n, k // 32, 2)
    packed = torch.cat([scale, codes.view(n, k // 32, 32).view(torch.uint8)], -1).reshape(n, -1)
    x = torch.where(torch.rand(2, k, generator=g) < 0.5, -1.0, 1.0)
    y = qgemv.qgemm(packed, "q8_0", x, None, path)
    assert_matches_reference(y, packed, "q8_0", x, None)
    q4 = torch.full((n, k // 32 * 18), 0xFF, dtype=torch.uint8)   # every 4-bit code 15
    q4.view(n, k // 32, 18)[..., :2] = scale
    assert_matches_reference(qgemv.qgemm(q4, "q4_0", x, None, path), q4, "q4_0", x, None)


def test_paths_agree_with_each_other():
    """The paths differ only in float32 summation order: within 1e-5 of Σ|term| of each other."""
    if len(qgemv.paths()) < 2:
        pytest.skip("one path only on this CPU")
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(64, 768, generator=g) * 0.02, torch.randn(1, 768, generator=g)
    for fmt in blocks.FORMATS:
        packed = blocks.quantize(w, fmt)
        ys = [qgemv.qgemm(packed, fmt, x, None, p).double() for p in qgemv.paths()]
        mag = blocks.magnitude(packed, fmt, x)
        for y in ys[1:]:
            assert bool(((y - ys[0]).abs() <= 1e-5 * mag).all())


def test_path_choice_and_override(monkeypatch):
    if qgemv.load() is None:
        pytest.skip(f"the block kernels are {qgemv.STATUS.get('state')}")
    here = qgemv.paths()
    assert here[0] == "scalar"
    monkeypatch.delenv(qgemv.FORCED, raising=False)
    assert qgemv.path() == here[-1]
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    if " avx2 " in flags and " fma " in flags and " f16c " in flags:
        assert "avx2" in here
    if " avx512_vnni " in flags and " avx512bw " in flags and " avx512vl " in flags:
        assert "avx512vnni" in here
    for p in here:
        monkeypatch.setenv(qgemv.FORCED, p)
        assert qgemv.path() == p
    monkeypatch.setenv(qgemv.FORCED, "neon")
    with pytest.raises(ConfigError, match="not a kernel path"):
        qgemv.path()


def test_bad_input_is_refused():
    if qgemv.load() is None:
        pytest.skip(f"the block kernels are {qgemv.STATUS.get('state')}")
    packed = blocks.quantize(torch.randn(4, 64), "q8_0")
    with pytest.raises(RuntimeError, match="x must be"):
        qgemv.qgemm(packed, "q8_0", torch.randn(1, 32))
    with pytest.raises(RuntimeError, match="blocks must be"):
        qgemv.qgemm(packed[:, :40], "q8_0", torch.randn(1, 64))
    with pytest.raises(ConfigError, match="unknown block format"):
        qgemv.qgemm(packed, "q2_k", torch.randn(1, 64))


def test_without_the_extension_torch_computes_the_same_with_one_warning():
    code = """
import warnings, torch
from tformer.quant import blocks, qgemv
g = torch.Generator().manual_seed(0)
packed, x = blocks.quantize(torch.randn(9, 96, generator=g), "q4_1"), torch.randn(2, 96, generator=g)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    y = qgemv.qgemm(packed, "q4_1", x)
    qgemv.qgemm(packed, "q4_1", x)
ref = blocks.reference(packed, "q4_1", x)
ok = bool(((y.double() - ref).abs() <= 1e-5 * blocks.magnitude(packed, "q4_1", x)).all())
print(qgemv.load() is None, len(caught), ok, qgemv.path())
"""
    env = dict(os.environ, TFORMER_NO_EXTENSION="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "1", "True", "None"]


@pytest.mark.parametrize("path", ["avx2", "avx512vnni"])
def test_tiles_lie_end_to_end_and_live_as_long_as_their_tensor(path):
    """repack places tiles made one after another end to end (64-byte aligned) in shared arenas of
    2 MB pages; an arena is unmapped only when its last tensor dies. 30 copies of a 2.4 MB weight
    (73 MB) fill more than one 64 MB arena; dropping every other copy must leave the rest intact."""
    runnable(path)
    g = torch.Generator().manual_seed(5)
    packed = blocks.quantize(torch.randn(1536, 1536, generator=g) * 0.02, "q8_0")
    x = torch.randn(1, 1536, generator=g)
    tiles = [qgemv.tiles(packed, "q8_0", path) for _ in range(30)]
    step = (tiles[0].nbytes + 63) // 64 * 64
    assert tiles[1].data_ptr() - tiles[0].data_ptr() == step
    assert tiles[0].data_ptr() % 64 == 0 and all(bool(torch.equal(t, tiles[0])) for t in tiles[1:])
    kept = tiles[1::2]
    del tiles
    fresh = [qgemv.tiles(packed, "q8_0", path) for _ in range(8)]         # new tiles overwrite nothing live
    assert all(bool(torch.equal(t, kept[0])) for t in fresh)
    for t in kept:
        assert_matches_reference(qgemv.qgemm(packed, "q8_0", x, None, path, t), packed, "q8_0", x, None)


@pytest.mark.parametrize("path", ["avx2", "avx512vnni"])
@pytest.mark.parametrize("fmt", blocks.FORMATS)
@pytest.mark.parametrize("m", [2, 3, 4, 8, 9])
def test_rows_at_a_time_match_the_reference_and_one_row_bitwise(path, fmt, m):
    """The tile kernels take up to 4 activation rows per pass over a tile (every group size 1..4
    here); each row's arithmetic is the one-row kernel's in the same order, so every row of an
    M-row product equals that row's product alone, bit for bit, and the float64 reference within
    the module's tolerance."""
    runnable(path)
    g = torch.Generator().manual_seed(m * 7 + len(fmt))
    w = torch.randn(45, 160, generator=g) * 0.05
    x = torch.randn(m, 160, generator=g) * 2
    x[-1, 32:64] = 0
    bias = torch.randn(45, generator=g)
    packed = blocks.quantize(w, fmt)
    tiled = qgemv.tiles(packed, fmt, path)
    y = qgemv.qgemm(packed, fmt, x, bias, path, tiled)
    assert_matches_reference(y, packed, fmt, x, bias)
    for r in range(m):
        assert torch.equal(y[r], qgemv.qgemm(packed, fmt, x[r:r + 1], bias, path, tiled)[0])


@pytest.mark.parametrize("path", ["avx2", "avx512vnni"])
def test_one_off_tiles_reuse_their_arena(path):
    """Tiles made and dropped one at a time (qgemm without ``tiled`` repacks on every call) land
    where the last ones were once their arena is empty, rather than filling arenas, and come out
    zero-padded over the dirtied bytes. A fresh process: no other test's tiles keep the arena."""
    runnable(path)
    code = f"""
import torch
from tformer.quant import blocks, qgemv
g = torch.Generator().manual_seed(6)
dirty = qgemv.tiles(blocks.quantize(torch.randn(64, 64, generator=g), "q4_0"), "q4_0", "{path}")
where = dirty.data_ptr()
dirty.fill_(255)
del dirty
packed = blocks.quantize(torch.randn(33, 64, generator=g), "q4_0")           # 33 rows: padded tiles
again = qgemv.tiles(packed, "q4_0", "{path}")
fresh = qgemv.tiles(packed, "q4_0", "{path}")                                  # after it: never dirtied
print(again.data_ptr() == where, fresh.data_ptr() != where, torch.equal(again, fresh))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True", "True"]


def test_the_timing_ops():
    """tile_passes (the benchmark's C++ loop) runs the same products, times them and refuses an x
    narrower than a matrix; product_ns counts time inside the tile products and resets."""
    if qgemv.load() is None:
        pytest.skip(f"the block kernels are {qgemv.STATUS.get('state')}")
    path = qgemv.paths()[-1]
    if path not in qgemv.TILE_ROWS:
        pytest.skip("no SIMD tile path on this CPU")
    op = qgemv.load()
    g = torch.Generator().manual_seed(7)
    packed = blocks.quantize(torch.randn(40, 64, generator=g), "q4_1")
    tiles = qgemv.tiles(packed, "q4_1", path)
    x = torch.randn(2, 96, generator=g)
    op.product_ns(True)
    assert op.product_ns(False) == 0
    sec = op.tile_passes([tiles, tiles], [2, 2], [40, 40], x, qgemv.PATHS.index(path), 3)
    assert 0 < sec < 1 and op.product_ns(True) > 0 and op.product_ns(False) == 0
    qgemv.qgemm(packed, "q4_1", x[:, :64], None, path, tiles)
    assert op.product_ns(True) > 0
    with pytest.raises(RuntimeError, match="narrower"):
        op.tile_passes([tiles], [2], [40], x[:, :32].contiguous(), qgemv.PATHS.index(path), 1)
