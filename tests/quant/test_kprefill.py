"""Several-row products (prompts) of the K-quants (Q4_K, Q5_K, Q6_K) on tiles widened on the fly (quant/kprefill.h:
from ``WIDEN_ROWS`` = 32 activation rows on the avx2 and avx512vnni paths; the scalar path keeps the one-row
kernels) and of Q5_0 / Q5_1 (tiles.h's tiles on those paths), on every path this CPU runs, each forced.

- against a float64 evaluation of the same quantised arithmetic (``kblocks.reference``, Q8_K / 8-bit block
  rounding of the activations included): the integer sums are exact, so only float32 rounding separates them;
  the widened path rounds once per block of 16 / 32 codes instead of once per super-block, so its error is
  relative to the blocks' terms, not their sum: 1e-5 · Σ_e |w_e| (|x_e| + step_e) is asked (that bounds
  Σ |block term|), plus half an ulp of the output dtype;
- against ``gguf.quants.dequantize`` and a float64 product (independent of tformer's maths): the activations'
  rounding moves each output by at most Σ_e |w_e| · step_e / 2 (step = the block's max|x| / 127), asked with
  1e-5 · Σ|w x| on top;
- against an independent float64 evaluation in numpy (``gguf.quants.dequantize`` for the weights, ggml's Q8_K
  rounding redone in numpy float32 for the activations), on the SIMD paths (the widened tiles) each forced, on the
  Q4_K_M file's own Q4_K / Q6_K weights and on random blocks of every K-quant: within 1e-4 · Σ|w| |x̂| per output
  (x̂ the rounded activations; the float32 roundings stay within ~1e-6 of that, a wrong code or scale is far above it);
- rows 32 and up give what they would give one at a time, within the same float32 rounding, and two threads
  give exactly what one gives (each output's sums do not depend on the split);
- a 40-token prompt of a Q4_K_M file (every position's logits) against the float import and against llama.cpp.
"""

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tformer.inference import open_model
from tformer.interop.gguf_import import load_gguf
from tformer.quant import kblocks, qgemv

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_kquants import GGUF_TYPE, check_against_reference, runnable  # noqa: E402


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("path", qgemv.PATHS)
@pytest.mark.parametrize("fmt", kblocks.FORMATS)
@pytest.mark.parametrize("n, k, m", [(37, 768, 33), (16, 512, 32), (5, 256, 35)])   # tile and row tails
def test_prompt_rows_match_float64_reference(path, fmt, n, k, m):
    check_against_reference(path, fmt, n, k, m, _magnitude)


def _magnitude(packed: torch.Tensor, fmt: str, x: torch.Tensor) -> torch.Tensor:
    """``Σ_e |w_e| (|x_e| + step_e)`` per output, ``(M, N)`` float64: at least the sum of every block's term
    in absolute value, what the widened path's per-block float32 rounding is relative to."""
    w = torch.from_numpy(gguf.quants.dequantize(packed.numpy(), GGUF_TYPE[fmt])).double().abs()
    return (x.double().abs() + _steps(x, fmt)) @ w.T


def _steps(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Each activation's rounding step: its block's max|x| / 127 (blocks of 256 for Q8_K, 32 for Q5)."""
    size = 256 if fmt in kblocks.KQUANTS else 32
    blocks = x.double().reshape(x.shape[0], -1, size)
    return (blocks.abs().amax(-1, keepdim=True) / 127).expand_as(blocks).reshape(x.shape)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("path", qgemv.PATHS)
@pytest.mark.parametrize("fmt", kblocks.FORMATS)
def test_prompt_rows_match_gguf_dequantised_product(path, fmt):
    runnable(path)
    g = torch.Generator().manual_seed(7)
    n, k, m = 21, 512, 34
    packed = kblocks.random_blocks(n, k, fmt, g)
    w = torch.from_numpy(gguf.quants.dequantize(packed.numpy(), GGUF_TYPE[fmt])).double()      # (n, k)
    x = torch.randn(m, k, generator=g)
    ref = x.double() @ w.T
    bound = 0.5 * _steps(x, fmt) @ w.abs().T * (1 + 1e-3) + 1e-5 * x.double().abs() @ w.abs().T
    err = (qgemv.kqgemm(packed, fmt, x, None, path).double() - ref).abs()
    assert bool((err <= bound).all()), float((err / bound).max())


def _q8k_numpy(x: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_q8_K_ref in numpy, then back to values: per block of 256, iscale = -127 / (the signed
    value of largest magnitude, the first such) in float32, codes rne(iscale · x) capped at 127, d = 1 / iscale;
    returns codes · d, ``(M, K)`` float64 (an all-zero block stays zero)."""
    M, K = x.shape
    b = x.astype(np.float32).reshape(M, K // 256, 256)
    big = np.take_along_axis(b, np.abs(b).argmax(-1)[..., None], -1)                # (M, S, 1)
    with np.errstate(divide="ignore"):
        iscale = np.where(big == 0, np.float32(0), np.float32(-127) / big).astype(np.float32)
        d = np.where(iscale == 0, np.float32(0), np.float32(1) / iscale).astype(np.float32)
    q = np.minimum(np.rint(b * iscale), 127)                                        # float32 product, half to even
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(M, K)


WIDE_ROWS = 42                            # WIDEN_ROWS (32) and up, with a tail of 2 rows past the passes of 4


def _weights_of_the_file():
    """The Q4_K_M file's weights as ``(name, fmt, packed (N, bytes))``: its real Q4_K and Q6_K blocks."""
    reader = gguf.GGUFReader(FILE)
    fmts = {gguf.GGMLQuantizationType.Q4_K: "q4_k", gguf.GGMLQuantizationType.Q6_K: "q6_k"}
    return [(t.name, fmts[t.tensor_type], torch.from_numpy(np.array(t.data)))
            for t in reader.tensors if t.tensor_type in fmts and t.name.startswith("blk.0.")]


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("path", list(qgemv.TILE_ROWS))
def test_widened_prompt_products_match_numpy_float64(path):
    """kprefill.h's widened tiles (``WIDE_ROWS`` rows, each SIMD path forced) against numpy: weights by
    ``gguf.quants.dequantize``, activations by ``_q8k_numpy``, the product and bias in float64."""
    runnable(path)
    g = torch.Generator().manual_seed(11)
    cases = [(name, fmt, packed, None) for name, fmt, packed in _weights_of_the_file()]
    cases += [(f"random {fmt}", fmt, kblocks.random_blocks(37, 768, fmt, g), torch.randn(37, generator=g))
              for fmt in kblocks.KQUANTS]                                           # 37: a tile tail on both paths
    assert {c[1] for c in cases} == set(kblocks.KQUANTS)
    for name, fmt, packed, bias in cases:
        w = gguf.quants.dequantize(packed.numpy(), GGUF_TYPE[fmt]).astype(np.float64)   # (N, K)
        x = torch.randn(WIDE_ROWS, w.shape[1], generator=g) * 2
        x[3, :256] = 0                                                              # an all-zero Q8_K block
        xq = _q8k_numpy(x.numpy())
        ref = xq @ w.T + (bias.double().numpy() if bias is not None else 0)
        got = qgemv.kqgemm(packed, fmt, x, bias, path).double().numpy()
        err, bound = np.abs(got - ref), 1e-4 * (np.abs(xq) @ np.abs(w).T) + 1e-30
        assert got.shape == ref.shape and (err <= bound).all(), (name, float((err / bound).max()))


@pytest.mark.parametrize("fmt", kblocks.FORMATS)
def test_prompt_rows_equal_one_row_at_a_time_and_any_thread_count(fmt):
    path = qgemv.path()
    if path not in qgemv.TILE_ROWS:
        pytest.skip("no SIMD path on this CPU: prompts take the one-row kernels")
    g = torch.Generator().manual_seed(5)
    packed = kblocks.random_blocks(40, 768, fmt, g)
    x = torch.randn(34, 768, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = qgemv.kqgemm(packed, fmt, x, None, path)
        rows = torch.cat([qgemv.kqgemm(packed, fmt, x[i:i + 1], None, path) for i in range(34)])
        torch.set_num_threads(2)
        two = qgemv.kqgemm(packed, fmt, x, None, path)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    bound = 1e-5 * _magnitude(packed, fmt, x) + 1e-30
    assert bool(((one.double() - rows.double()).abs() <= bound).all())


FILE = Path(__file__).resolve().parents[1] / "data" / "qwen2-tiny-q4_k_m.gguf"   # Q4_K + Q6_K (tests/data/README.md)
PROMPT = [(7 * i + 3) % 256 for i in range(40)]                                # 40 rows: the widened products


@pytest.fixture(scope="module")
def opened():
    return open_model(FILE)


@pytest.mark.usefixtures("one_thread")
def test_a_prompt_of_a_q4_k_m_file_near_the_float_import(opened):
    """Every position's logits of a 40-token prompt (each product on widened tiles) against the float32
    import of the same file: only the activations' Q8_K rounding differs, max |Δ| <= 5% of the scale
    (test_kquant_models.py's rule for its 14-token prompt)."""
    with torch.inference_mode():
        ours = opened.model(torch.tensor([PROMPT]))[0][0]
        ref = load_gguf(FILE)(torch.tensor([PROMPT]))[0][0]
    assert ours.shape == ref.shape == (40, 256) and ref.abs().max() > 0.1
    assert float((ours - ref).abs().max()) <= 0.05 * float(ref.abs().max())


@pytest.mark.usefixtures("one_thread")
def test_a_prompt_of_a_q4_k_m_file_equals_llama_cpp(opened):
    """The same prompt in llama.cpp (the same Q8_K arithmetic): within 1e-4 of the scale."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (the `bench` extra) is not installed")
    from tformer.interop.llama_cpp import LlamaCpp

    want = torch.from_numpy(LlamaCpp(FILE, n_ctx=64, threads=1, logits_all=True, f32_cache=True).logits(PROMPT))
    with torch.inference_mode():
        got = opened.model(torch.tensor([PROMPT]))[0][0]
    assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max())
