"""The one-pass ReLU² kernel (ops/relu2_cpu.cpp) against the formula in float64 and, bit for bit,
against the PyTorch Function it replaces (max then square; ×2 is exact)."""

from __future__ import annotations

import pytest
import torch

from tformer.nn.feed_forward import _ReLUSquared, relu_squared
from tformer.ops import relu2_cpu


@pytest.fixture(autouse=True)
def _built():
    if relu2_cpu.load() is None:
        pytest.skip(f"the CPU ReLU² kernel is {relu2_cpu.STATUS.get('state')}")


@pytest.mark.parametrize("shape", [(12, 64, 512), (3, 7), (1,), (2, 5, 33)])   # vector body and scalar tails
def test_matches_the_formula_and_the_torch_function_bit_for_bit(shape):
    torch.manual_seed(len(shape))
    x = torch.randn(*shape, requires_grad=True)
    g = torch.randn(*shape)
    y = relu_squared(x)
    y.backward(g)
    xd = x.detach().double()
    assert torch.allclose(y.double(), xd.clamp_min(0) ** 2, rtol=1.2e-7, atol=0)          # one float32 rounding
    assert torch.allclose(x.grad.double(), 2 * xd.clamp_min(0) * g.double(), rtol=1.2e-7, atol=0)
    x2 = x.detach().clone().requires_grad_()
    y2 = _ReLUSquared.apply(x2)
    y2.backward(g)
    assert torch.equal(y, y2) and torch.equal(x.grad, x2.grad)


def test_takes_float32_on_the_cpu_only_and_non_contiguous_input():
    assert relu2_cpu.serves(torch.randn(3)) and not relu2_cpu.serves(torch.randn(3, dtype=torch.float64))
    x = torch.randn(8, 6).t().requires_grad_()                        # a transposed view
    relu_squared(x).sum().backward()
    assert torch.equal(x.grad, 2 * x.detach().clamp_min(0))
