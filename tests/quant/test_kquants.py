"""K-quants (Q4_K, Q5_K, Q6_K) and Q5_0 / Q5_1: dequantisation equal to ``gguf.quants.dequantize`` bit for bit, the
activations' Q8_K rounding, and every kernel path this CPU runs (kquants.h: scalar, avx2, avx512vnni,
each forced) against a float64 evaluation of the same quantised arithmetic (tformer.quant.kblocks.reference).

Tolerance: the integer sums over a super-block are exact and the codes are the reference's, so only
float32 rounding separates a kernel from the reference: the conversion of a super-block's integer sum
(up to ~2^28, one rounding of 2^-24 relative), its two scale products and the sum over S super-blocks,
~(S + 4) · 2^-24 of Σ|term|. 1e-5 · Σ|term| is asked, plus half an ulp of the output dtype.
"""

import gguf
import numpy as np
import pytest
import torch

from tformer.quant import kblocks, qgemv
from tformer.quant.block_linear import BlockLinear

pytestmark = pytest.mark.usefixtures("one_thread")
HALF_ULP = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}
GGUF_TYPE = {"q4_k": gguf.GGMLQuantizationType.Q4_K, "q5_k": gguf.GGMLQuantizationType.Q5_K,
             "q6_k": gguf.GGMLQuantizationType.Q6_K, "q5_0": gguf.GGMLQuantizationType.Q5_0,
             "q5_1": gguf.GGMLQuantizationType.Q5_1}


def runnable(path):
    if qgemv.load() is None:
        pytest.skip(f"the block kernels are {qgemv.STATUS.get('state')}")
    if path not in qgemv.paths():
        pytest.skip(f"this CPU does not run the {path} path (it runs {', '.join(qgemv.paths())})")


@pytest.mark.parametrize("fmt", kblocks.FORMATS)
def test_dequantize_equals_gguf_bit_for_bit(fmt):
    g = torch.Generator().manual_seed(1)
    packed = kblocks.random_blocks(9, 768, fmt, g, scale=0.05)        # every code and scale byte at random
    ours = kblocks.dequantize(packed, fmt).numpy()
    theirs = gguf.quants.dequantize(packed.numpy(), GGUF_TYPE[fmt])
    assert ours.shape == theirs.shape == (9, 768)
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))


def test_q8k_rounding_follows_ggml():
    """ggml's quantize_row_q8_K_ref: iscale = -127 / (the signed value of largest magnitude), codes
    rne(iscale · x) capped at 127, d = 1 / iscale, bsums per 16 codes."""
    x = torch.zeros(2, 512)
    x[0, :256] = torch.linspace(-1, 3, 256)
    x[0, 256:] = torch.linspace(2, -5, 256)
    x[1, :3] = torch.tensor([0.5, -0.5, 1.0])                         # max 1: iscale -127, two ties
    q, d, bsums = kblocks.quantize_activation(x)
    assert q.shape == (2, 2, 256) and d.shape == (2, 2) and bsums.shape == (2, 2, 16)
    assert int(q[0, 0, -1]) == -127 and int(q[0, 1, -1]) == -127     # the max (3, then -5) maps to -127
    assert int(q[0, 0, 0]) == 42                                      # -1 · (-127 / 3) = 42.33
    assert float(d[0, 0]) == pytest.approx(-3 / 127) and float(d[0, 1]) == pytest.approx(5 / 127)
    assert d[1, 1] == 0 and (q[1, 1] == 0).all()                      # an all-zero block
    assert (bsums == q.reshape(2, 2, 16, 16).sum(-1)).all()
    err = (q.float() * d[..., None] - x.reshape(2, 2, 256)).abs()
    assert bool((err <= d.abs()[..., None] / 2 * (1 + 1e-6)).all())  # within half a step
    # iscale = -127 / 1 = -127: 0.5 -> -63.5 -> -64 (even), -0.5 -> 63.5 -> 64 (even)
    assert q[1, 0, :2].tolist() == [-64, 64]


@pytest.mark.parametrize("path", qgemv.PATHS)
@pytest.mark.parametrize("fmt", kblocks.FORMATS)
@pytest.mark.parametrize("n, k, m", [(7, 256, 1), (37, 768, 1), (13, 2048, 5), (3, 512, 2)])
def test_every_path_matches_float64_reference(path, fmt, n, k, m):
    check_against_reference(path, fmt, n, k, m, kblocks.magnitude)


def check_against_reference(path, fmt, n, k, m, magnitude):
    """``kqgemm`` on random blocks and activations (a zero block among them), with and without a bias, float32
    and bfloat16 in, against ``kblocks.reference``: within 1e-5 · ``magnitude`` plus half an ulp of the dtype."""
    runnable(path)
    g = torch.Generator().manual_seed(n * k + m)
    packed = kblocks.random_blocks(n, k, fmt, g)
    x = torch.randn(m, k, generator=g) * 3
    x[0, :256] = 0                                                     # a zero activation block (scale 0)
    bias = torch.randn(n, generator=g)
    for b in (bias, None):
        for xs in (x, x.bfloat16()):
            y = qgemv.kqgemm(packed, fmt, xs, b, path)
            assert y.shape == (m, n) and y.dtype == xs.dtype
            ref = kblocks.reference(packed, fmt, xs.float(), b)
            bound = 1e-5 * magnitude(packed, fmt, xs.float()) + HALF_ULP[y.dtype] * ref.abs() + 1e-30
            err = (y.double() - ref).abs()
            assert bool((err <= bound).all()), float((err / bound).max())


@pytest.mark.parametrize("path", qgemv.PATHS)
@pytest.mark.parametrize("fmt", ["q5_0", "q5_1"])
@pytest.mark.parametrize("n, k, m", [(5, 96, 1), (9, 864, 5)])                # odd block counts: the AVX-512 tail
def test_q5_odd_block_counts_match_reference(path, fmt, n, k, m):
    runnable(path)
    g = torch.Generator().manual_seed(n + k)
    packed = kblocks.random_blocks(n, k, fmt, g)
    x = torch.randn(m, k, generator=g)
    ref = kblocks.reference(packed, fmt, x)
    err = (qgemv.kqgemm(packed, fmt, x, None, path).double() - ref).abs()
    assert bool((err <= 1e-5 * kblocks.magnitude(packed, fmt, x) + 1e-30).all())


@pytest.mark.parametrize("fmt", kblocks.FORMATS)
def test_torch_fallback_matches_reference(fmt):
    g = torch.Generator().manual_seed(3)
    packed = kblocks.random_blocks(11, 512, fmt, g)
    x = torch.randn(2, 512, generator=g)
    ref = kblocks.reference(packed, fmt, x)
    err = (kblocks.dot(packed, fmt, x).double() - ref).abs()
    assert bool((err <= 1e-5 * kblocks.magnitude(packed, fmt, x) + 1e-30).all())


@pytest.mark.parametrize("fmt", kblocks.FORMATS)
def test_block_linear_runs_kquants_close_to_the_float_weight(fmt):
    """A BlockLinear over K-quant bytes: its shape, and its product against the dequantised weight's
    float product (only the activations' 8-bit rounding separates them: ~1% of |x|·|W| per output)."""
    runnable(qgemv.PATHS[0])
    g = torch.Generator().manual_seed(4)
    packed = kblocks.random_blocks(24, 512, fmt, g)
    layer = BlockLinear(packed, fmt, torch.randn(24, generator=g))
    assert (layer.out_features, layer.in_features) == (24, 512)
    x = torch.randn(3, 4, 512, generator=g)
    y = layer(x)
    w = layer.dequantized()
    exact = x @ w.T + layer.bias
    scale = (x.abs() @ w.abs().T)
    assert y.shape == (3, 4, 24)
    assert bool(((y - exact).abs() <= 0.02 * scale).all())
    assert np.array_equal(w.numpy(), gguf.quants.dequantize(packed.numpy(), GGUF_TYPE[fmt]))


@pytest.mark.parametrize("path", qgemv.PATHS)
@pytest.mark.parametrize("fmt", ["q5_0", "q5_1"])
def test_q5_extreme_codes_do_not_saturate(path, fmt):
    """Every Q5 code 31 against activations all at ±127 (AVX2 sums one quad's two maddubs in s16:
    4 · 31 · 127 = 15748 < 2¹⁵), and every code 0 (q5_0's -16 alone)."""
    runnable(path)
    g = torch.Generator().manual_seed(2)
    n, k = 19, 160
    for byte in (0xFF, 0x00):
        packed = kblocks.random_blocks(n, k, fmt, g)
        b = packed.view(n, k // 32, kblocks.BYTES[fmt])
        b[..., kblocks.BYTES[fmt] - 20:] = byte                              # qh and qs: every bit set (or none)
        x = torch.where(torch.rand(3, k, generator=g) < 0.5, -1.0, 1.0)
        ref = kblocks.reference(packed, fmt, x)
        err = (qgemv.kqgemm(packed, fmt, x, None, path).double() - ref).abs()
        assert bool((err <= 1e-5 * kblocks.magnitude(packed, fmt, x) + 1e-30).all())


@pytest.mark.parametrize("path", ["avx2", "avx512vnni"])
@pytest.mark.parametrize("fmt", ["q5_0", "q5_1"])
def test_q5_tiles_hold_the_file_bytes_and_rows_at_a_time_equal_one_row(path, fmt):
    """Q5 tiles (tiles.h: the file's bytes moved, TILE_ROWS rows interleaved) are as large as the
    padded file rows; an M-row product over them agrees with the float64 reference of the quantised
    arithmetic and equals each row's product alone bit for bit."""
    runnable(path)
    g = torch.Generator().manual_seed(5)
    n, k = 37, 192
    packed = kblocks.random_blocks(n, k, fmt, g)
    tiled = qgemv.tiles(packed, fmt, path)
    R = qgemv.TILE_ROWS[path]
    assert tiled.shape == (-(-n // R), R * packed.shape[1])
    x = torch.randn(9, k, generator=g)
    y = qgemv.kqgemm(packed, fmt, x, None, path, tiled)
    err = (y.double() - kblocks.reference(packed, fmt, x)).abs()
    assert bool((err <= 1e-5 * kblocks.magnitude(packed, fmt, x) + 1e-30).all())
    for r in range(9):
        assert torch.equal(y[r], qgemv.kqgemm(packed, fmt, x[r:r + 1], None, path, tiled)[0])
