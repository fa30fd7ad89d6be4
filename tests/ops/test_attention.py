"""Scaled dot-product attention against PyTorch's own F.scaled_dot_product_attention (fp32, atol 1e-6, rtol 1e-6)."""

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from tformer import choose_backend, scaled_dot_product_attention as sdpa

ATOL = 1e-6  # absolute
RTOL = 1e-6  # relative: fp32 rounding differs with the order of the sums
BACKENDS = ["math", "torch", "auto", "flash"]

# (batch, heads, n, m, d_k, d_v): n == m, n < m, n > m, d_k != d_v, single query, single key.
SHAPES = [
    (2, 3, 5, 5, 8, 8),
    (1, 2, 4, 9, 16, 4),
    (2, 1, 7, 3, 5, 11),
    (3, 4, 1, 6, 8, 8),
    (1, 1, 6, 1, 4, 2),
    (2, 2, 33, 17, 32, 64),
]


def _qkv(b, h, n, m, dk, dv, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, n, dk, generator=g), torch.randn(b, h, m, dk, generator=g),
            torch.randn(b, h, m, dv, generator=g))


def _random_mask(shape, seed):
    """A random bool mask in which every row keeps at least one key (torch gives NaN otherwise)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(shape, generator=g) > 0.4
    mask[..., 0] = True
    return mask


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_torch_plain(shape, backend):
    q, k, v = _qkv(*shape)
    ref = F.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(sdpa(q, k, v, backend=backend), ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_torch_bool_and_float_masks(shape, backend):
    b, h, n, m, dk, dv = shape
    q, k, v = _qkv(*shape, seed=1)
    for mask_shape in [(n, m), (b, 1, n, m), (b, h, n, m), (b, 1, 1, m)]:
        mask = _random_mask(mask_shape, seed=2)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        torch.testing.assert_close(sdpa(q, k, v, mask=mask, backend=backend), ref, atol=ATOL, rtol=RTOL)
        bias = torch.randn(mask_shape)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        torch.testing.assert_close(sdpa(q, k, v, bias=bias, backend=backend), ref, atol=ATOL, rtol=RTOL)
        # bool mask and float bias together equal a float mask with -inf where masked
        combined = bias.masked_fill(~mask, float("-inf"))
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=combined)
        torch.testing.assert_close(sdpa(q, k, v, mask=mask, bias=bias, backend=backend), ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [s for s in SHAPES if s[2] <= s[3]])
def test_causal_is_bottom_right_aligned(shape, backend):
    """With n <= m the queries are the last n positions: PyTorch's causal_lower_right."""
    b, h, n, m, dk, dv = shape
    q, k, v = _qkv(*shape, seed=3)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(n, m))
    torch.testing.assert_close(sdpa(q, k, v, causal=True, backend=backend), ref, atol=ATOL, rtol=RTOL)
    if n == m:  # and then it is also the ordinary is_causal
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.testing.assert_close(sdpa(q, k, v, causal=True, backend=backend), ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_with_mask_and_scale(backend):
    q, k, v = _qkv(2, 2, 6, 10, 8, 8, seed=4)
    mask = _random_mask((2, 1, 1, 10), seed=5)
    mask[..., 4:] = True  # keep every causal row non-empty
    dense = causal_lower_right(6, 10)._materialize() & mask
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, scale=0.3)
    torch.testing.assert_close(sdpa(q, k, v, mask=mask, causal=True, scale=0.3, backend=backend), ref,
                               atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("leading", [(), (5,), (2, 3)])
def test_any_leading_dims(leading, backend):
    g = torch.Generator().manual_seed(6)
    q = torch.randn(*leading, 4, 6, 8, generator=g)
    k = torch.randn(*leading, 4, 9, 8, generator=g)
    v = torch.randn(*leading, 4, 9, 5, generator=g)
    ref = F.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(sdpa(q, k, v, backend=backend), ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n,m,causal", [(5, 5, True), (1, 8, True), (3, 8, True), (4, 7, False)])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_grouped_query_attention_equals_repeated_kv(kv_heads, n, m, causal, backend):
    """GQA/MQA: each kv head serves n_heads/kv_heads query heads; reference repeats K/V explicitly."""
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 8, n, 16, generator=g)
    k = torch.randn(2, kv_heads, m, 16, generator=g)
    v = torch.randn(2, kv_heads, m, 8, generator=g)
    rep = 8 // kv_heads
    mask = causal_lower_right(n, m) if causal else None
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask)
    torch.testing.assert_close(sdpa(q, k, v, causal=causal, backend=backend), ref, atol=ATOL, rtol=RTOL)
    pad = torch.ones(2, 1, 1, m, dtype=torch.bool)
    pad[0, ..., : m // 2] = False
    pad[0, ..., -1] = True
    dense = pad if mask is None else pad & mask._materialize()
    ok = dense.any(-1, keepdim=True)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                         attn_mask=dense | ~ok).masked_fill(~ok, 0)
    torch.testing.assert_close(sdpa(q, k, v, mask=pad, causal=causal, backend=backend), ref, atol=ATOL, rtol=RTOL)


def test_weights_rows_sum_to_one_and_match_softmax():
    q, k, v = _qkv(2, 3, 5, 7, 8, 4, seed=8)
    out, w = sdpa(q, k, v, causal=True, return_weights=True)
    assert w.shape == (2, 3, 5, 7)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 3, 5), atol=1e-6, rtol=0)
    scores = (q @ k.transpose(-1, -2)) / 8 ** 0.5
    scores = scores.masked_fill(~causal_lower_right(5, 7)._materialize(), float("-inf"))
    torch.testing.assert_close(w, torch.softmax(scores, -1), atol=1e-6, rtol=0)
    torch.testing.assert_close(out, w @ v, atol=1e-6, rtol=0)
    assert choose_backend(q, k, return_weights=True)[0] == "math"


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_masked_row_gives_zeros_not_nan(backend):
    q, k, v = _qkv(1, 2, 4, 6, 8, 8, seed=9)
    q.requires_grad_(True)
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[2] = False
    out = sdpa(q, k, v, mask=mask, backend=backend)
    assert not torch.isnan(out).any()
    assert torch.equal(out[..., 2, :], torch.zeros_like(out[..., 2, :]))
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.equal(q.grad[..., 2, :], torch.zeros(1, 2, 8))
    # causal with more queries than keys: the first n - m queries see nothing
    q2, k2, v2 = _qkv(1, 1, 5, 3, 4, 4, seed=10)
    out = sdpa(q2, k2, v2, causal=True, backend=backend)
    assert torch.equal(out[..., :2, :], torch.zeros(1, 1, 2, 4))
    ref = F.scaled_dot_product_attention(q2[..., 2:, :], k2, v2, is_causal=True)
    torch.testing.assert_close(out[..., 2:, :], ref, atol=ATOL, rtol=RTOL)
    # a bias of -inf everywhere on a row is the same as masking it
    bias = torch.zeros(4, 6)
    bias[1] = float("-inf")
    out = sdpa(q.detach(), k, v, bias=bias, backend=backend)
    assert torch.equal(out[..., 1, :], torch.zeros(1, 2, 8)) and not torch.isnan(out).any()


@pytest.mark.parametrize("backend", ["math", "torch", "flash"])
def test_gradients_match_torch(backend):
    shapes = [(2, 4, 5, 7, 8, 6)]
    for shape in shapes:
        q, k, v = (t.double().requires_grad_(True) for t in _qkv(*shape, seed=11))
        bias = torch.randn(shape[2], shape[3], dtype=torch.float64)
        out = sdpa(q, k, v, bias=bias, causal=True, backend=backend)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        dense = bias.masked_fill(~causal_lower_right(shape[2], shape[3])._materialize(), float("-inf"))
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense)
        ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
        for a, b in itertools.chain([(out, ref)], zip(grads, ref_grads)):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


def test_bf16_inputs_are_close_to_fp32():
    q, k, v = _qkv(1, 2, 16, 16, 32, 32, seed=12)
    ref = sdpa(q, k, v, causal=True, backend="math")
    for backend in ["math", "torch", "flash"]:
        out = sdpa(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True, backend=backend)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=0)


def test_bad_requests_raise_clear_errors():
    q, k, v = _qkv(1, 4, 3, 5, 8, 8)
    with pytest.raises(ValueError, match="share d_k"):
        sdpa(q, k[..., :4], v)
    with pytest.raises(ValueError, match="one value per key"):
        sdpa(q, k, v[..., :4, :])
    with pytest.raises(ValueError, match="not a multiple"):
        sdpa(q, k[:, :3], v[:, :3])
    with pytest.raises(ValueError, match="unknown attention backend 'fast'.*math"):
        sdpa(q, k, v, backend="fast")
    with pytest.raises(ValueError, match="cannot return attention weights"):
        sdpa(q, k, v, backend="torch", return_weights=True)
    with pytest.raises(ValueError, match="bool tensor"):
        sdpa(q, k, v, mask=torch.ones(3, 5))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n,m,window,causal", [(8, 8, 3, True), (4, 10, 2, True), (9, 9, 4, False), (1, 12, 5, True)])
def test_sliding_window_matches_explicit_band(n, m, window, causal, backend):
    """Query at key position p = i + m - n sees keys j with p - window < j <= p (|p - j| < window if not causal)."""
    q, k, v = _qkv(2, 2, n, m, 8, 8, seed=13)
    band = torch.zeros(n, m, dtype=torch.bool)
    for i in range(n):
        p = i + m - n
        for j in range(m):
            band[i, j] = (p - window < j <= p) if causal else abs(p - j) < window
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=band)
    out = sdpa(q, k, v, causal=causal, window=window, backend=backend)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_prompt_on_a_cpu_without_native_support_attends_in_float32(dtype, monkeypatch):
    """Where the CPU emulates the 16-bit type, a prompt's attention runs on float32 copies and is rounded
    back once: the float32 result of the same (rounded) inputs to within one rounding of the dtype. Decode
    steps (one query row) keep the dtype."""
    import tformer.machine as machine
    monkeypatch.setattr(machine, "half_native", lambda dt: False)     # as on the AVX2 EPYC, on any CPU
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 4, 9, 16, generator=g).to(dtype) for _ in range(3))
    out = sdpa(q, k, v, causal=True, backend="torch")
    ref = sdpa(q.float(), k.float(), v.float(), causal=True, backend="torch")
    assert out.dtype == dtype and torch.equal(out, ref.to(dtype))
    q1 = q[:, :, -1:]                                               # one query row: a decode step
    widened = sdpa(q1.float(), k.float(), v.float(), causal=True, backend="torch").to(dtype)
    one = sdpa(q1, k, v, causal=True, backend="torch")
    monkeypatch.setattr(machine, "half_native", lambda dt: True)   # a CPU with the type native: no copies
    native = sdpa(q1, k, v, causal=True, backend="torch")
    assert not torch.equal(widened, native)                         # the two paths differ here, so this can fail
    assert one.dtype == dtype and torch.equal(one, native)
    assert not torch.equal(sdpa(q, k, v, causal=True, backend="torch"), out)   # the prompt: native differs too
