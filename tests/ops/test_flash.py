"""tformer's flash backend against the math backend and PyTorch's F.scaled_dot_product_attention.

Tolerances: fp64 outputs and gradients to 1e-10 (atol and rtol), fp32 to 1e-5 (scaled up where the scores
are large, see test_outputs_and_gradients_equal_math), bf16 inputs within
bf16 rounding (rtol 1.6e-2) of the fp32 result. Small block sizes are used so that n and m cover
several blocks that are not multiples of the block size.
"""

import itertools
import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch.nn.attention.bias import causal_lower_right

from tformer import DecoderLM, MultiHeadAttention, TransformerConfig, choose_backend
from tformer import scaled_dot_product_attention as sdpa
from tformer.ops.flash import FULL, SKIP, _Geometry, flash_attention
from tformer.ops.alibi import alibi_bias, alibi_slopes

F64 = dict(atol=1e-10, rtol=1e-10)
F32 = dict(atol=1e-5, rtol=1e-5)


def _inputs(b, hq, hkv, n, m, dk, dv, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, n, dk, generator=g, dtype=dtype).requires_grad_(True)
    k = torch.randn(b, hkv, m, dk, generator=g, dtype=dtype).requires_grad_(True)
    v = torch.randn(b, hkv, m, dv, generator=g, dtype=dtype).requires_grad_(True)
    return q, k, v


def _out_and_grads(fn, tensors, seed=1):
    out = fn()
    g = torch.Generator().manual_seed(seed)
    dout = torch.randn(out.shape, generator=g, dtype=out.dtype)
    grads = torch.autograd.grad(out, tensors, dout)
    return [out, *grads]


# Derandomized: CI explores the same examples every run. TFORMER_HYPOTHESIS_EXAMPLES=300 searches
# more, TFORMER_HYPOTHESIS_RANDOM=1 draws new examples.
@settings(max_examples=int(os.environ.get("TFORMER_HYPOTHESIS_EXAMPLES", 30)), deadline=None,
          derandomize=os.environ.get("TFORMER_HYPOTHESIS_RANDOM") is None)
@given(
    b=st.integers(1, 2), hkv=st.integers(1, 2), groups=st.sampled_from([1, 3]),
    n=st.integers(1, 300), m=st.integers(1, 300), dk=st.integers(1, 17), dv=st.integers(1, 9),
    causal=st.booleans(), window=st.one_of(st.none(), st.integers(1, 80)),
    alibi=st.booleans(), pad=st.sampled_from(["none", "keys", "keys+empty", "dense"]),
    dense_bias=st.booleans(), block_q=st.integers(16, 96), block_k=st.integers(16, 96),
    seed=st.integers(0, 2**16), fp32=st.booleans(),
)
def test_outputs_and_gradients_equal_math(b, hkv, groups, n, m, dk, dv, causal, window, alibi,
                                          pad, dense_bias, block_q, block_k, seed, fp32):
    """Outputs, dq, dk, dv, d(bias) and d(alibi slopes) over random shapes and features: fp64 to
    1e-10 (atol and rtol); fp32 to 1e-5 (gradients: atol 1e-5 * sqrt(terms summed), see below)."""
    hq = hkv * groups
    dtype = torch.float32 if fp32 else torch.float64
    q, k, v = _inputs(b, hq, hkv, n, m, dk, dv, dtype=dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    mask = None
    if pad.startswith("keys"):
        mask = torch.rand(b, 1, 1, m, generator=g) > 0.3
        if pad == "keys+empty":
            mask[0] = False  # a whole batch row with no key: every query of it is fully masked
    elif pad == "dense":
        mask = torch.rand(b, hq, n, m, generator=g) > 0.3
    leaves = [q, k, v]
    slopes = bias = None
    if alibi:
        slopes = (torch.rand(hq, generator=g, dtype=dtype) + 0.05).requires_grad_(True)
        leaves.append(slopes)
    if dense_bias:
        bias = torch.randn(1, hq, n, m, generator=g, dtype=dtype).requires_grad_(True)
        leaves.append(bias)
    kw = dict(mask=mask, bias=bias, alibi_slopes=slopes, causal=causal, window=window)
    ref = _out_and_grads(lambda: sdpa(q, k, v, backend="math", **kw), leaves)
    got = _out_and_grads(lambda: flash_attention(q, k, v, block_q=block_q, block_k=block_k, **kw), leaves)
    names = ["out", "dq", "dk", "dv"] + ["dslopes"] * alibi + ["dbias"] * dense_bias
    if not fp32:
        for name, a, r in zip(names, got, ref):
            assert torch.isfinite(a).all(), name
            torch.testing.assert_close(a, r, **F64, msg=lambda s: f"{name}: {s}")
        return
    # fp32: 1e-5, times sqrt(number of terms summed) for the gradients that are long fp32 sums of
    # cancelling terms (both backends round differently; for m = 1, say, math's d(slopes) is exactly 0).
    # d(slopes) sums b·n·m terms of size up to max(n, m): an fp32 bound would be as large as the value
    # itself, so it is checked in fp64 only (above, to 1e-10).
    terms = {"out": 1, "dq": m, "dk": n * groups, "dv": n * groups, "dbias": b}
    # Scores of magnitude S carry fp32 rounding of about S * 6e-8 into exp(): ALiBi over 300
    # positions reaches S ~ 300, so the bound grows with S beyond 10.
    s_max = (float(slopes.detach().max()) * max(n, m) if alibi else 0.0) + (float(bias.detach().abs().max()) if dense_bias else 0.0)
    grow = max(1.0, s_max / 10)
    for name, a, r in zip(names, got, ref):
        assert torch.isfinite(a).all(), name
        if name == "dslopes":
            continue
        atol = 1e-5 * terms[name] ** 0.5 * grow
        torch.testing.assert_close(a, r, atol=atol, rtol=1e-5, msg=lambda s: f"{name}: {s}")


@pytest.mark.parametrize("n,m", [(77, 77), (45, 130), (130, 45), (1, 70)])
@pytest.mark.parametrize("hkv", [1, 2, 4])
@pytest.mark.filterwarnings("ignore:Lower right causal bias")
def test_fp32_matches_pytorch_sdpa(n, m, hkv):
    """Against PyTorch's own kernel: causal (lower-right) and key padding, GQA, fp32 to 1e-5."""
    q, k, v = _inputs(2, 4, hkv, n, m, 32, 16, dtype=torch.float32, seed=n + m)
    rep = 4 // hkv
    kr, vr = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    pad = torch.ones(2, 1, 1, m, dtype=torch.bool)
    pad[1, ..., : m // 3] = False
    pad[1, ..., -1] = True  # every query keeps at least its last key, so PyTorch gives no NaN
    dense = pad & causal_lower_right(n, m)._materialize()
    live = dense.any(-1, keepdim=True)
    ref = _out_and_grads(lambda: F.scaled_dot_product_attention(q, kr, vr, attn_mask=dense | ~live)
                         .masked_fill(~live, 0.0), [q, k, v])
    got = _out_and_grads(lambda: flash_attention(q, k, v, mask=pad, causal=True, block_q=32, block_k=40), [q, k, v])
    for a, r in zip(got, ref):
        torch.testing.assert_close(a, r, **F32)


def test_fp32_window_and_alibi_match_math_through_the_entry_point():
    q, k, v = _inputs(1, 8, 2, 300, 300, 64, 64, dtype=torch.float32, seed=3)
    slopes = alibi_slopes(8)
    for kw in [dict(causal=True, window=50), dict(window=33), dict(causal=True, alibi_slopes=slopes)]:
        ref = _out_and_grads(lambda: sdpa(q, k, v, backend="math", **kw), [q, k, v])
        got = _out_and_grads(lambda: sdpa(q, k, v, backend="flash", **kw), [q, k, v])
        for a, r in zip(got, ref):
            torch.testing.assert_close(a, r, **F32)


def test_dense_alibi_of_the_entry_point_is_positions_alibi_bias():
    """The math/torch path turns slopes into exactly tformer.ops.alibi.alibi_bias (queries last)."""
    q, k, v = _inputs(2, 4, 4, 5, 9, 8, 8, dtype=torch.float32, seed=4)
    slopes = alibi_slopes(4)
    bias = alibi_bias(slopes, torch.arange(4, 9), torch.arange(9))
    for backend in ["math", "torch", "flash"]:
        out = sdpa(q, k, v, causal=True, alibi_slopes=slopes, backend=backend)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.masked_fill(
            ~causal_lower_right(5, 9)._materialize(), float("-inf")))
        torch.testing.assert_close(out, ref, **F32)


def test_gradcheck_fp64_small():
    """torch.autograd.gradcheck of the custom backward, every feature on, blocks of 3 x 4."""
    q, k, v = _inputs(1, 4, 2, 7, 9, 3, 2, seed=5)
    slopes = torch.tensor([0.5, 0.25, 0.1, 0.05], dtype=torch.float64, requires_grad=True)
    bias = torch.randn(4, 7, 9, dtype=torch.float64, requires_grad=True)
    pad = torch.ones(1, 1, 1, 9, dtype=torch.bool)
    pad[..., 1] = False

    def fn(q, k, v, slopes, bias):
        return flash_attention(q, k, v, mask=pad, bias=bias, alibi_slopes=slopes, causal=True,
                               window=5, block_q=3, block_k=4)

    assert torch.autograd.gradcheck(fn, (q, k, v, slopes, bias))
    q2, k2, v2 = _inputs(2, 2, 1, 5, 3, 4, 3, seed=6)  # n > m causal: the first rows see nothing
    assert torch.autograd.gradcheck(lambda q, k, v: flash_attention(q, k, v, causal=True, block_q=2, block_k=2),
                                    (q2, k2, v2))


def test_fully_masked_rows_are_zero_with_finite_gradients():
    q, k, v = _inputs(2, 2, 2, 40, 40, 8, 8, dtype=torch.float32, seed=7)
    pad = torch.ones(2, 1, 1, 40, dtype=torch.bool)
    pad[1] = False
    out = flash_attention(q, k, v, mask=pad, causal=True, block_q=16, block_k=16)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isfinite(out).all()
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert torch.equal(q.grad[1], torch.zeros_like(q.grad[1]))


def test_bf16_inputs_accumulate_in_fp32():
    """bf16 in, bf16 out; equal to the fp32 math result on the same (bf16-rounded) inputs up to the
    final bf16 rounding, i.e. no bf16 accumulation error over 700 keys."""
    q, k, v = (t.detach().bfloat16() for t in _inputs(1, 4, 2, 300, 700, 64, 64, dtype=torch.float32, seed=8))
    out = sdpa(q, k, v, causal=True, backend="flash")
    assert out.dtype == torch.bfloat16
    ref = sdpa(q.float(), k.float(), v.float(), causal=True, backend="math")
    torch.testing.assert_close(out.float(), ref, atol=1e-5, rtol=1.6e-2)


def test_no_n_by_m_tensor_is_saved_for_backward():
    """O(n) memory: nothing the kernel keeps for backward has n*m elements (n = m = 512, d = 16)."""
    q, k, v = _inputs(1, 1, 1, 512, 512, 16, 16, dtype=torch.float32, seed=9)
    sizes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
        flash_attention(q, k, v, mask=torch.ones(1, 1, 1, 512, dtype=torch.bool),
                        alibi_slopes=torch.tensor([0.5]), causal=True, window=100)
    assert sizes and max(sizes) <= 512 * 16 < 512 * 512


def test_masked_blocks_are_skipped():
    """Causal visits about half of the blocks, a window only a band (the rest are never computed)."""
    full = _Geometry(1024, 1024, False, None, 128, 128).visited()
    assert full == 64
    assert _Geometry(1024, 1024, True, None, 128, 128).visited() == 8 * 9 // 2      # lower triangle + diagonal
    assert _Geometry(1024, 1024, True, 100, 128, 128).visited() == 8 + 7           # diagonal + one below
    assert _Geometry(1024, 1024, False, 100, 128, 128).visited() == 8 + 2 * 7      # symmetric band
    assert _Geometry(100, 1024, True, None, 128, 128).visited() == 8                # decoding-like: last block row
    for causal, window in itertools.product([True, False], [None, *range(1, 25)]):
        geo = _Geometry(40, 33, causal, window, 7, 5)  # skipped exactly when no pair is allowed
        for i0, i1 in geo.q_blocks:
            for j0, j1 in geo.k_blocks:
                allowed = geo.structural(i0, i1, j0, j1, "cpu").expand(i1 - i0, 1, j1 - j0)
                state = geo.state(i0, i1, j0, j1)
                assert bool(allowed.any()) == (state != SKIP)
                assert bool(allowed.all()) == (state == FULL)


def test_auto_chooses_and_explains():
    q, k = torch.randn(1, 8, 2048, 64), torch.randn(1, 8, 2048, 64)
    assert choose_backend(q, k, causal=True)[0] == "torch"
    assert choose_backend(q, k, causal=True, return_weights=True)[0] == "math"
    name, why = choose_backend(q, k, causal=True, alibi_slopes=alibi_slopes(8))
    assert name == "flash" and "ALiBi" in why
    name, why = choose_backend(q, k, causal=True, window=256)
    assert name == "flash" and "sliding-window" in why
    name, why = choose_backend(q, k, causal=True, mask=torch.ones(1, 1, 1, 2048, dtype=torch.bool))
    assert name == "flash" and "key padding" in why
    assert choose_backend(q, k, mask=torch.ones(1, 1, 1, 2048, dtype=torch.bool))[0] == "torch"  # broadcast, not dense
    name, why = choose_backend(q, k, causal=True, window=256, dropout_p=0.1)
    assert name == "torch" and "dropout" in why
    name, why = choose_backend(q, k, mask=torch.ones(2048, 2048, dtype=torch.bool))
    assert name == "torch" and "passed in" in why
    name, why = choose_backend(q[..., :1024, :], k[..., :1024, :], window=16)
    assert name == "torch" and "FLASH_MIN_PAIRS" in why
    assert choose_backend(q[..., :1, :], k, causal=True)[0] == "torch"  # one query sees all keys: no mask
    name, why = choose_backend(q[..., :1100, :], k, causal=True)
    assert name == "flash" and "n=1100 != m=2048" in why
    assert choose_backend(q, k, backend="flash") == ("flash", "requested explicitly")


def test_flash_refuses_dropout_and_bad_inputs_clearly():
    q, k, v = _inputs(1, 2, 2, 4, 4, 8, 8, dtype=torch.float32)
    with pytest.raises(ValueError, match="no attention dropout"):
        sdpa(q, k, v, dropout_p=0.1, backend="flash")
    with pytest.raises(ValueError, match="alibi_slopes must have shape"):
        flash_attention(q, k, v, alibi_slopes=torch.ones(3))
    with pytest.raises(ValueError, match="does not broadcast"):
        flash_attention(q, k, v, mask=torch.ones(1, 1, 3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="attn_dropout=0"):
        TransformerConfig(attention_backend="flash", attn_dropout=0.1)
    with pytest.raises(ValueError, match="share d_k"):
        flash_attention(q, k[..., :4], v)
    with pytest.raises(ValueError, match="block_q"):
        flash_attention(q, k, v, block_q=0)


@pytest.mark.parametrize("positions,window", [("alibi", None), ("rope", 7)])
def test_model_with_flash_config_equals_math(positions, window):
    """A whole DecoderLM (GQA, padding, ALiBi or RoPE + sliding window): logits and parameter grads."""
    torch.manual_seed(0)
    cfg = dict(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, context_length=40, positions=positions,
               sliding_window=window)
    models = {}
    for backend in ["math", "flash"]:
        torch.manual_seed(0)
        models[backend] = DecoderLM(TransformerConfig(attention_backend=backend, **cfg)).double()
    ids = torch.randint(0, 256, (2, 33))
    attention_mask = torch.ones(2, 33, dtype=torch.long)
    attention_mask[1, :5] = 0
    results = {}
    for backend, model in models.items():
        logits, loss = model(ids, ids, attention_mask=attention_mask)
        loss.backward()
        results[backend] = [logits] + [p.grad for p in model.parameters()]
    for a, r in zip(results["flash"], results["math"]):
        torch.testing.assert_close(a, r, **F64)


def test_mha_alibi_slopes_equal_old_dense_bias():
    """MultiHeadAttention now passes slopes; the result equals attention with the dense alibi.alibi_bias."""
    torch.manual_seed(1)
    mha = MultiHeadAttention(TransformerConfig(d_model=32, n_heads=4, positions="alibi", attention_backend="math"))
    x = torch.randn(2, 11, 32)
    q, k, v = mha.qkv_proj(x).view(2, 11, 3, 4, 8).permute(2, 0, 3, 1, 4)
    bias = alibi_bias(alibi_slopes(4), torch.arange(11), torch.arange(11))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.masked_fill(
        ~causal_lower_right(11, 11)._materialize(), float("-inf")))
    ref = mha.out_proj(ref.transpose(1, 2).reshape(2, 11, 32))
    for backend in ["math", "torch", "flash"]:
        mha.backend = backend
        torch.testing.assert_close(mha(x), ref, **F32)


@pytest.mark.parametrize("causal,window,alibi", [(True, None, False), (True, 40, False), (False, 30, True),
                                                 (True, None, True), (False, None, False)])
@pytest.mark.parametrize("n,m,groups", [(150, 150, 1), (97, 160, 2), (160, 97, 3)])
def test_forward_on_fused_blocks_equals_math_fp64(causal, window, alibi, n, m, groups):
    """Without masks or dense biases and with d_k = d_v, the CPU forward merges PyTorch's fused kernel
    over key ranges by their log-sum-exps: outputs and gradients equal math in fp64 to 1e-10."""
    q, k, v = _inputs(2, 2 * groups, 2, n, m, 8, 8, seed=n + m)
    leaves = [q, k, v]
    slopes = None
    if alibi:
        slopes = (torch.rand(2 * groups, generator=torch.Generator().manual_seed(3), dtype=torch.float64) + 0.05)
        leaves.append(slopes.requires_grad_(True))
    kw = dict(alibi_slopes=slopes, causal=causal, window=window)
    ref = _out_and_grads(lambda: sdpa(q, k, v, backend="math", **kw), leaves)
    got = _out_and_grads(lambda: flash_attention(q, k, v, block_q=32, block_k=48, **kw), leaves)
    for a, r in zip(got, ref):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, r, **F64)
