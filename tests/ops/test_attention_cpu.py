"""The ``short`` CPU attention kernel and RoPE's fused rotation (ops/attention_cpu.cpp) against float64
references of the same formulas, forward and every gradient; and where ``auto`` uses them.

Tolerances: float32 accumulation over at most a few hundred terms of O(1) values, so 1e-5 absolute
on outputs and gradients of unit-scale inputs (measured errors are 2e-7 to 2e-6).
"""

from __future__ import annotations

import math

import pytest
import torch

from tformer.config import TransformerConfig
from tformer.errors import InputError
from tformer.models import build_model
from tformer.nn.positions import RotaryEmbedding
from tformer.ops import attention_cpu
from tformer.ops.sdpa import choose_backend, scaled_dot_product_attention

TOL = 1e-5


@pytest.fixture(autouse=True)
def _built():
    if attention_cpu.load() is None:
        pytest.skip(f"the CPU attention kernel is {attention_cpu.STATUS.get('state')}")


def reference(q, k, v, causal, scale):
    """softmax(scale Q Kᵀ [bottom-right causal]) V in float64, key/value heads repeated for GQA; a
    query with no visible key gets 0."""
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    n, m = q.shape[-2], k.shape[-2]
    if causal:
        s = s.masked_fill(~torch.ones(n, m, dtype=torch.bool).tril(m - n), float("-inf"))
    return torch.softmax(s, -1).nan_to_num(0.0) @ v


def strided(B, H, T, D, requires_grad=True):
    """(B, H, T, D) as split_heads makes it: a transposed view of (B, T, H, D) memory."""
    return torch.randn(B, T, H, D).transpose(1, 2).requires_grad_(requires_grad)


@pytest.mark.parametrize("B,Hq,Hkv,n,m,D,causal", [
    (2, 4, 4, 64, 64, 32, True),       # tformer's CPU training shape
    (3, 6, 2, 37, 37, 16, True),       # grouped-query heads, odd length
    (2, 4, 4, 5, 19, 64, True),        # fewer queries than keys: bottom-right causal
    (1, 2, 1, 33, 50, 40, False),      # full attention, a head size that is not a multiple of 32
    (2, 3, 3, 1, 1, 8, True),          # one token
    (1, 2, 2, 70, 70, 96, True),
])
def test_forward_and_gradients_match_float64(B, Hq, Hkv, n, m, D, causal):
    torch.manual_seed(n * 100 + m)
    q = strided(B, Hq, n, D)
    k, v = torch.randn(B, Hkv, m, D, requires_grad=True), torch.randn(B, Hkv, m, D, requires_grad=True)
    out = scaled_dot_product_attention(q, k, v, causal=causal, backend="short")
    g = torch.randn_like(out)
    out.backward(g)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = reference(*ref_in, causal, 1 / math.sqrt(D))
    ref.backward(g.double())
    assert (out.double() - ref).abs().max() < TOL
    for got, want in zip((q, k, v), ref_in):
        assert (got.grad.double() - want.grad).abs().max() < TOL


def test_output_is_laid_out_for_the_output_projection():
    q, k, v = strided(2, 4, 16, 32), strided(2, 4, 16, 32), strided(2, 4, 16, 32)
    out = scaled_dot_product_attention(q, k, v, causal=True, backend="short")
    assert out.transpose(1, 2).is_contiguous()          # (B, T, H, D) memory: merging heads is a view


def test_a_query_with_no_visible_key_gets_zero_and_no_gradient():
    """Causal with more queries than keys (the op itself: the backend entry refuses it): the first
    rows see nothing; their output is 0, their log-sum-exp -inf, nothing is NaN."""
    q, k, v = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    out, lse = attention_cpu.load().attend(q, k, v, True, 0.5)
    ref = reference(q, k, v, True, 0.5)
    assert torch.isfinite(out).all() and (out.double() - ref).abs().max() < TOL
    assert (out[:, :, :3] == 0).all() and torch.isinf(lse[:, :, :3]).all()
    g = torch.randn_like(out)
    dq, dk, dv = attention_cpu.load().attend_backward(g, q, k, v, out, lse, True, 0.5)
    assert torch.isfinite(dq).all() and (dq[:, :, :3] == 0).all()
    assert torch.isfinite(dk).all() and torch.isfinite(dv).all()


def test_auto_takes_it_in_training_steps_only():
    q, k = torch.randn(2, 4, 64, 32, requires_grad=True), torch.randn(2, 4, 64, 32)
    assert choose_backend(q, k, causal=True)[0] == "short"
    with torch.no_grad():
        assert choose_backend(q, k, causal=True)[0] == "torch"          # inference keeps PyTorch's kernel
    assert choose_backend(q.detach(), k, causal=True)[0] == "torch"
    assert choose_backend(q, k, causal=True, dropout_p=0.1)[0] == "torch"
    assert choose_backend(q.double(), k.double(), causal=True)[0] == "torch"
    assert choose_backend(torch.randn(1, 1, 8, 12, requires_grad=True), torch.randn(1, 1, 8, 12))[0] == "torch"
    long = torch.randn(1, 1, attention_cpu.auto_max_keys() + 1, 8)    # served, but slower than PyTorch's there
    assert attention_cpu.serves(long, long, long, causal=True) is None
    assert choose_backend(long.requires_grad_(), long.detach(), causal=True)[0] == "torch"
    longest = torch.randn(1, 1, attention_cpu.MAX_KEYS + 1, 8)
    assert attention_cpu.serves(longest, longest, longest, causal=True) is not None


@pytest.mark.parametrize("capability, limit", [("AVX2", 512), ("AVX512", 256), ("DEFAULT", 0), ("SVE256", 0)])
def test_auto_s_key_limit_follows_the_vector_width_of_pytorch_s_own_kernel(capability, limit, monkeypatch):
    """The kernel is AVX2 everywhere; PyTorch's fused kernel runs as wide as the CPU, so on AVX-512 it
    wins from fewer keys (whole steps there: 1.04-1.09x at 512 keys; where PyTorch runs AVX2 the kernel is
    0.80x at 512)."""
    assert attention_cpu.CAPABILITY == torch.backends.cpu.get_cpu_capability()
    monkeypatch.setattr(attention_cpu, "CAPABILITY", capability)
    assert attention_cpu.auto_max_keys() == limit
    for m in (64, 256, 257, 512, 513):
        x = torch.randn(1, 1, m, 8, requires_grad=True)
        expected = "short" if m <= limit else "torch"
        assert choose_backend(x, x.detach(), causal=True)[0] == expected, (capability, m)


def test_values_of_another_width_fall_back_under_auto():
    q, k, v = torch.randn(1, 2, 8, 16, requires_grad=True), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 24)
    out = scaled_dot_product_attention(q, k, v, causal=True)
    assert out.shape == (1, 2, 8, 24) and (out.double() - reference(q, k, v, True, 0.25)).abs().max() < TOL


@pytest.mark.parametrize("why", [dict(mask=torch.ones(1, 8, dtype=torch.bool)), dict(window=4), dict(dropout_p=0.1)])
def test_an_explicit_request_it_cannot_serve_names_why(why):
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(InputError, match="backend 'short' cannot take"):
        scaled_dot_product_attention(q, q, q, causal=True, backend="short", **why)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_row", [False, True])
def test_rope_rotation_and_its_gradient_match_the_formula(per_row, dtype, monkeypatch):
    """The fused rotation against x cos + rotate_half(x) sin in float64, tables (T, D) and (B, T, D)
    (positions per row), through RotaryEmbedding, which must have taken the kernel; bfloat16 (autocast's
    q and k) rotated in float32 and rounded once: within half a bf16 step of |x| <= 8 (2^-6)."""
    calls = []
    monkeypatch.setattr(attention_cpu._Rotate, "apply",
                        (lambda f: lambda *a: calls.append(1) or f(*a))(attention_cpu._Rotate.apply))
    torch.manual_seed(3)
    B, H, T, D = 2, 3, 10, 32
    rope = RotaryEmbedding(D, 64)
    x = torch.randn(B, T, H, D).to(dtype).transpose(1, 2).requires_grad_()
    positions = torch.randint(0, 60, (B, T)) if per_row else torch.arange(T)
    y = rope(x, positions)
    g = torch.randn(y.shape).to(dtype)
    y.backward(g)
    xd = x.detach().double().requires_grad_()
    cos, sin = rope.cos[positions].double(), rope.sin[positions].double()
    if per_row:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = D // 2
    want = xd * cos + torch.cat([-xd[..., half:], xd[..., :half]], -1) * sin
    want.backward(g.double())
    tol = TOL if dtype == torch.float32 else 2.0 ** -6
    assert calls == [1] and y.dtype == x.grad.dtype == dtype
    assert (y.double() - want).abs().max() < tol and (x.grad.double() - xd.grad).abs().max() < tol


def test_a_model_trains_the_same_through_the_kernels_and_through_torch(monkeypatch):
    """One loss and every gradient of a small RoPE decoder: ``auto`` (both kernels) against the same
    weights through PyTorch's attention (``attention_backend="torch"``) and the formula rotation."""
    torch.manual_seed(0)
    cfg = dict(vocab_size=50, context_length=32, n_layers=2, d_model=64, n_heads=4, positions="rope")
    ours = build_model(TransformerConfig(**cfg))
    theirs = build_model(TransformerConfig(**cfg, attention_backend="torch"))
    theirs.load_state_dict(ours.state_dict())
    ids = torch.randint(0, 50, (3, 32))
    calls = []
    for fn in (attention_cpu._Attend, attention_cpu._Rotate):           # count that the kernels ran
        monkeypatch.setattr(fn, "apply", (lambda f: lambda *a: calls.append(f) or f(*a))(fn.apply))
    _, loss = ours(ids, targets=ids)
    loss.backward()
    assert len(calls) == 2 * 3                                            # per layer: attention, rotate q and k
    monkeypatch.setattr(attention_cpu, "rotates", lambda x, cos: False)     # the formula's eight ops
    _, ref = theirs(ids, targets=ids)
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), abs=1e-6)
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        assert (a.grad - b.grad).abs().max() < TOL, name


def test_bf16_training_attention_runs_the_kernel_on_bf16_itself(monkeypatch):
    """Under bf16 (autocast's inputs) a training call takes the kernel with the bf16 tensors themselves
    (no float32 copies in between) and returns bf16 values and gradients."""
    seen = []
    monkeypatch.setattr(attention_cpu._Attend, "apply",
                        (lambda f: lambda q, k, v, *a: seen.append(q.dtype) or f(q, k, v, *a))(attention_cpu._Attend.apply))
    q, k, v = (torch.randn(2, 4, 32, 16).bfloat16().requires_grad_() for _ in range(3))
    out = scaled_dot_product_attention(q, k, v, causal=True)
    out.float().sum().backward()
    assert seen == [torch.bfloat16] and out.dtype == torch.bfloat16
    assert q.grad.dtype == k.grad.dtype == v.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("B,Hq,Hkv,n,m,D,causal", [
    (2, 4, 4, 64, 64, 32, True),       # tformer's CPU training shape
    (3, 6, 2, 37, 37, 16, True),       # grouped-query heads (their dk, dv summed before one rounding)
    (2, 4, 4, 5, 19, 64, True),        # fewer queries than keys
    (1, 2, 1, 33, 50, 40, False),
])
def test_bf16_forward_and_gradients_match_float64(B, Hq, Hkv, n, m, D, causal):
    """bf16 in and out against the float64 reference on the same (bf16-valued) inputs: within bf16's
    resolution, 1/128 of the largest value of each result (an 8-bit significand rounds by <= 1/256)."""
    torch.manual_seed(n * 100 + m + 1)
    q = torch.randn(B, n, Hq, D).bfloat16().transpose(1, 2).requires_grad_()
    k, v = (torch.randn(B, Hkv, m, D).bfloat16().requires_grad_() for _ in range(2))
    out = scaled_dot_product_attention(q, k, v, causal=causal, backend="short")
    g = torch.randn(out.shape).bfloat16()
    out.backward(g)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = reference(*ref_in, causal, 1 / math.sqrt(D))
    ref.backward(g.double())
    assert out.dtype == torch.bfloat16
    for got, want in ((out, ref), *((t.grad, r.grad) for t, r in zip((q, k, v), ref_in))):
        assert got.dtype == torch.bfloat16
        assert (got.double() - want).abs().max() <= want.abs().max().clamp(min=1.0) / 128


def test_bf16_output_is_the_float32_kernel_s_rounded_once_to_nearest_even():
    """The kernel widens bf16 rows exactly and rounds each result once, to nearest even, as
    ``Tensor.to(torch.bfloat16)`` does: its bf16 output equals its float32 output on the widened inputs,
    rounded, bit for bit. With q = 0 every visible key weighs the same, so causal row 1 is exactly
    (v_0 + v_1) / 2: pairs whose mean falls halfway between two bf16 values show the ties going to the
    even one (1 + 2^-8 -> 1, 1 + 3·2^-8 -> 1 + 2^-6)."""
    torch.manual_seed(3)
    q = torch.zeros(2, 4, 24, 16, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 4, 24, 16).bfloat16() for _ in range(2))
    v[0, 0, :2, 0] = torch.tensor([1.0, 1 + 2 ** -7])
    v[0, 0, :2, 1] = torch.tensor([1 + 2 ** -7, 1 + 2 ** -6])
    op = attention_cpu.load()
    o16, l16 = op.attend(q, k, v, True, 0.25)
    o32, l32 = op.attend(q.float(), k.float(), v.float(), True, 0.25)
    assert torch.equal(o16, o32.bfloat16()) and torch.equal(l16, l32)
    assert o16[0, 0, 1, :2].tolist() == [1.0, 1 + 2 ** -6]
