"""The one-pass tanh-GELU kernel (ops/gelu_tanh_cpu.cpp) against PyTorch's formula in float64 (libm's
tanh) and against ``F.gelu(approximate="tanh")`` in float32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tformer.nn.feed_forward import ACTIVATIONS
from tformer.ops import gelu_tanh_cpu


@pytest.fixture(autouse=True)
def _built():
    if gelu_tanh_cpu.load() is None:
        pytest.skip(f"the CPU tanh-GELU kernel is {gelu_tanh_cpu.STATUS.get('state')}")


def _inputs(shape, seed):
    torch.manual_seed(seed)
    x = torch.randn(*shape) * 3
    tails = torch.tensor([-30.0, -10.0, -6.0, -3.0, -1e-3, 0.0, 1e-3, 3.0, 6.0, 10.0, 30.0])
    flat = x.view(-1)
    n = min(len(tails), flat.numel())
    flat[:n] = tails[:n]                          # the far tails (e^-2u clamped), 0 and tiny values
    return x


@pytest.mark.parametrize("shape", [(12, 64, 512), (3, 7), (1,), (2, 5, 33)])   # vector body and scalar tails
def test_the_value_and_the_derivative_match_float64(shape):
    x = _inputs(shape, len(shape)).requires_grad_()
    g = torch.randn(*shape)
    y = gelu_tanh_cpu.GELUTanh.apply(x)
    (dx,) = torch.autograd.grad(y, x, g)
    xd = x.detach().double().requires_grad_()
    yd = F.gelu(xd, approximate="tanh")
    (dxd,) = torch.autograd.grad(yd, xd, g.double())
    # float32 rounding of y (|y| <= 30 here: 2e-6 is about one ulp there) and of the derivative;
    # 1 - s as e^-2u s keeps the derivative's tail (where s rounds to 1) from being off by 6e-8 |x| du
    assert (y.double() - yd).abs().max() < 4e-6
    assert (dx.double() - dxd).abs().max() < 1e-6 * g.abs().max()
    big = yd.abs() > 1e-2
    if big.any():
        assert ((y.double() - yd)[big] / yd[big]).abs().max() < 1e-6
    assert (y - F.gelu(x.detach(), approximate="tanh")).abs().max() < 4e-6
    assert torch.isfinite(dx).all()


def test_the_mlp_takes_the_kernel_in_training_only():
    x = torch.randn(4, 8, requires_grad=True)
    assert gelu_tanh_cpu.serves(x) and not gelu_tanh_cpu.serves(x.detach())
    assert not gelu_tanh_cpu.serves(torch.randn(3, dtype=torch.float64, requires_grad=True))
    with torch.no_grad():
        assert not gelu_tanh_cpu.serves(x)
        assert torch.equal(ACTIVATIONS["gelu_tanh"](x), F.gelu(x, approximate="tanh"))   # inference: PyTorch's
    assert type(ACTIVATIONS["gelu_tanh"](x).grad_fn).__name__ == "GELUTanhBackward"       # not GeluBackward0
    assert type(ACTIVATIONS["gelu"](x).grad_fn).__name__ == "GeluBackward0"               # the erf form: F.gelu


def test_a_non_contiguous_input():
    x = torch.randn(8, 6).t().requires_grad_()                        # a transposed view
    gelu_tanh_cpu.gelu_tanh(x).sum().backward()
    xd = x.detach().double().requires_grad_()
    F.gelu(xd, approximate="tanh").sum().backward()
    assert torch.allclose(x.grad.double(), xd.grad, atol=1e-6, rtol=0)
