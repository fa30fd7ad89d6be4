"""attention/dropout.py: the CPU attention-dropout kernel against the formula written out in fp64 with the
same keep mask (1e-10, outputs and gradients), and its Bernoulli draws against their stated probability."""

import math

import pytest
import torch

from tformer.ops.dropout import dropout_attention, keep_mask, keep_probability
from tformer.ops.sdpa import scaled_dot_product_attention


def test_keep_probability_is_p_rounded_to_16_bits():
    assert keep_probability(0.2) == 1 - 13107 / 65536
    assert keep_probability(0.0) == 1.0 and keep_probability(1.0) == 0.0
    assert bool(keep_mask((1000,), 0.0).all()) and not bool(keep_mask((1000,), 1.0).any())


@pytest.mark.parametrize("p", [0.1, 0.2, 0.5])
def test_keep_mask_rate_and_independence(p):
    torch.manual_seed(0)
    keep = keep_mask((1 << 20,), p).double()
    q = keep_probability(p)
    sigma = math.sqrt(q * (1 - q) / keep.numel())
    assert abs(keep.mean().item() - q) < 5 * sigma                       # the rate, within 5 sigma
    x = keep - q                                                          # neighbours (same and next word)
    for lag in (1, 3, 4, 5):
        corr = (x[:-lag] * x[lag:]).mean().item() / (q * (1 - q))
        assert abs(corr) < 5 / math.sqrt(keep.numel())


def _reference(q, k, v, keep, p, causal):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        n, m = s.shape[-2:]
        s = s.masked_fill(torch.ones(n, m, dtype=torch.bool).triu(1), float("-inf"))
    return (torch.softmax(s, -1) * keep / keep_probability(p)) @ v


@pytest.mark.parametrize("causal", [True, False])
def test_equals_formula_with_the_same_mask_fp64(causal):
    p, shape = 0.2, (2, 3, 7, 5)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(*shape, dtype=torch.float64, generator=gen, requires_grad=True) for _ in range(3))
    g = torch.randn(*shape, dtype=torch.float64, generator=gen)
    torch.manual_seed(7)
    out = dropout_attention(q, k, v, p=p, scale=1 / math.sqrt(5), causal=causal)
    grads = torch.autograd.grad(out, (q, k, v), g)
    torch.manual_seed(7)
    keep = keep_mask((2, 3, 7, 7), p)                                     # the same draws
    assert 0 < int((~keep).sum())                                         # something was dropped
    ref = _reference(q, k, v, keep, p, causal)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


@pytest.mark.parametrize("n,m,rows", [(11, 11, 4), (11, 11, 64), (7, 11, 3), (11, 7, 3)])
def test_causal_blocks_equal_formula_with_the_same_mask_fp64(n, m, rows):
    """Causal attention in query blocks (rows s..e-1 see keys < e): the dense formula, any block size,
    also with n != m (top-left causal) and a last block shorter than the rest."""
    p = 0.2
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 3, n, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    k, v = (torch.randn(2, 3, m, 5, dtype=torch.float64, generator=gen, requires_grad=True) for _ in range(2))
    g = torch.randn(2, 3, n, 5, dtype=torch.float64, generator=gen)
    torch.manual_seed(8)
    out = dropout_attention(q, k, v, p=p, scale=1 / math.sqrt(5), causal=True, block_rows=rows)
    grads = torch.autograd.grad(out, (q, k, v), g)
    torch.manual_seed(8)
    keep = keep_mask((2, 3, n, m), p)
    ref = _reference(q, k, v, keep, p, True)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
    for a, b in zip(grads, torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


def test_drop_mask_is_not_keep_mask_from_the_same_draws():
    from tformer.ops.dropout import drop_mask
    torch.manual_seed(4)
    drop = drop_mask((3, 1000), 0.3)
    torch.manual_seed(4)
    assert torch.equal(drop, ~keep_mask((3, 1000), 0.3)) and 0 < int(drop.sum()) < drop.numel()


def test_unbiased_over_draws():
    """E[dropout attention] = attention without dropout: the mean of 400 draws is within 5 standard errors."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 6, 4, dtype=torch.float64, generator=gen) for _ in range(3))
    torch.manual_seed(0)
    draws = torch.stack([dropout_attention(q, k, v, p=0.3, scale=0.5, causal=True) for _ in range(400)])
    exact = _reference(q, k, v, torch.ones(6, 6, dtype=torch.bool), 0.0, True)
    assert ((draws.mean(0) - exact).abs() <= 5 * draws.std(0) / 20 + 1e-12).all()


def test_cpu_training_attention_with_dropout_takes_this_kernel():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 8, 4, generator=gen) for _ in range(3))
    torch.manual_seed(5)
    a = scaled_dot_product_attention(q, k, v, causal=True, dropout_p=0.2)
    torch.manual_seed(5)
    b = dropout_attention(q, k, v, p=0.2, scale=0.5, causal=True)
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_bf16_autocast_training_attention_matches_fp32():
    """Under bf16 autocast on CPU the fused kernel runs in fp32 (faster there): the result is the fp32 one, rounded."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 2, 16, 8, generator=gen).bfloat16().requires_grad_() for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = scaled_dot_product_attention(q, k, v, causal=True)
    assert out.dtype == torch.bfloat16
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)


def test_dropout_equals_formula_with_the_same_mask_fp64():
    from tformer.ops.dropout import dropout
    x = torch.randn(3, 5, 7, dtype=torch.float64, requires_grad=True)
    g = torch.randn(3, 5, 7, dtype=torch.float64)
    torch.manual_seed(11)
    out = dropout(x, 0.3)
    (dx,) = torch.autograd.grad(out, x, g)
    torch.manual_seed(11)
    keep = keep_mask((3, 5, 7), 0.3)
    c = 1 / keep_probability(0.3)
    torch.testing.assert_close(out, x * keep * c, atol=1e-12, rtol=0)
    torch.testing.assert_close(dx, g * keep * c, atol=1e-12, rtol=0)
    assert dropout(x, 0.3, training=False) is x or torch.equal(dropout(x, 0.3, training=False), x)
