"""The one-pass activation kernels (ops/activation_cpu.cpp): ReLU² against the formula in float64 and,
bit for bit, against the PyTorch Function it replaces (max then square; ×2 is exact); GELU's tanh form
against PyTorch's formula in float64 (libm's tanh) and against ``F.gelu(approximate="tanh")`` in float32;
the exact GELU (value and saved derivative) against the erf formula in float64 (libm's erf)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tformer.nn.feed_forward import ACTIVATIONS, _ReLUSquared, gelu, gelu_tanh, relu_squared
from tformer.ops import activation_cpu


@pytest.fixture(autouse=True)
def _built():
    if activation_cpu.load() is None:
        pytest.skip(f"the CPU activation kernels are {activation_cpu.STATUS.get('state')}")


# ---------------------------------------------------------------- ReLU²
@pytest.mark.parametrize("shape", [(12, 64, 512), (3, 7), (1,), (2, 5, 33)])   # vector body and scalar tails
def test_relu2_matches_the_formula_and_the_torch_function_bit_for_bit(shape):
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


def test_relu2_takes_float32_on_the_cpu_only_and_non_contiguous_input():
    assert activation_cpu.serves(torch.randn(3), "relu2")
    assert not activation_cpu.serves(torch.randn(3, dtype=torch.float64), "relu2")
    assert not activation_cpu.serves(torch.randn(3), "silu")                # not a kernel here
    x = torch.randn(8, 6).t().requires_grad_()                        # a transposed view
    relu_squared(x).sum().backward()
    assert torch.equal(x.grad, 2 * x.detach().clamp_min(0))


# ---------------------------------------------------------------- GELU, tanh form
def _inputs(shape, seed):
    torch.manual_seed(seed)
    x = torch.randn(*shape) * 3
    tails = torch.tensor([-30.0, -10.0, -6.0, -3.0, -1e-3, 0.0, 1e-3, 3.0, 6.0, 10.0, 30.0])
    flat = x.view(-1)
    n = min(len(tails), flat.numel())
    flat[:n] = tails[:n]                          # the far tails (e^-2u clamped), 0 and tiny values
    return x


@pytest.mark.parametrize("shape", [(12, 64, 512), (3, 7), (1,), (2, 5, 33)])   # vector body and scalar tails
def test_gelu_tanh_and_its_derivative_match_float64(shape):
    x = _inputs(shape, len(shape)).requires_grad_()
    g = torch.randn(*shape)
    y = activation_cpu.Pointwise.apply(x, "gelu_tanh")
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


def test_the_mlp_takes_the_tanh_gelu_kernel_in_training_and_inference():
    x = torch.randn(4, 8, requires_grad=True)
    assert type(ACTIVATIONS["gelu_tanh"](x).grad_fn).__name__ == "PointwiseBackward"      # not GeluBackward0
    assert ACTIVATIONS["gelu_tanh"](x.detach()).grad_fn is None
    with torch.no_grad():                                              # inference: the kernel's forward alone
        y = ACTIVATIONS["gelu_tanh"](x)
        assert torch.equal(y, activation_cpu.load().gelu_tanh(x.detach().contiguous()))
        assert (y - F.gelu(x, approximate="tanh")).abs().max() < 4e-6
    assert type(ACTIVATIONS["gelu"](x).grad_fn).__name__ == "GeluErfBackward"             # the erf form's kernel
    with torch.no_grad():
        assert torch.equal(ACTIVATIONS["gelu"](x), F.gelu(x))                              # inference: F.gelu
    x64 = torch.randn(3, dtype=torch.float64, requires_grad=True)
    assert type(ACTIVATIONS["gelu_tanh"](x64).grad_fn).__name__ == "GeluBackward0"


def test_a_non_contiguous_input():
    x = torch.randn(8, 6).t().requires_grad_()                        # a transposed view
    gelu_tanh(x).sum().backward()
    xd = x.detach().double().requires_grad_()
    F.gelu(xd, approximate="tanh").sum().backward()
    assert torch.allclose(x.grad.double(), xd.grad, atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_activation_in_inference_is_the_float32_kernel_rounded_once(dtype, monkeypatch):
    """A bf16 / fp16 prompt on a CPU that emulates the type: the float32 kernel on the widened input,
    rounded back once, so within one rounding of the dtype of PyTorch's float64 value; one row (a decode
    step) and a CPU with the type native keep ``F.gelu``; under autograd bf16 takes the kernel in bf16
    itself (:func:`test_bf16_training_activations_round_the_float32_kernel_once`), fp16 keeps ``F.gelu``."""
    import tformer.machine as machine
    monkeypatch.setattr(machine, "half_native", lambda dt: False)     # as on the AVX2 EPYC, on any CPU
    x = (torch.randn(6, 40, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    with torch.no_grad():
        y = ACTIVATIONS["gelu_tanh"](x)
    ref = F.gelu(x.double(), approximate="tanh")
    ulp = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]      # half an ulp: one rounding
    assert y.dtype == dtype and bool(((y.double() - ref).abs() <= ulp * ref.abs() + 1e-6).all())
    assert torch.equal(y, activation_cpu.load().gelu_tanh(x.float()).to(dtype))        # the kernel's path, not ATen's
    with torch.no_grad():
        aten = F.gelu(x, approximate="tanh")
        # one row against ATen on that row: ATen's AVX-512 loop rounds a row alone and the same row inside
        # 6 x 40 differently in places (its vector body and tail fall elsewhere; seen on a Xeon)
        aten_row = F.gelu(x[:1], approximate="tanh")
        assert not torch.equal(aten_row, y[:1])                  # the two paths differ here, so the checks can fail
        assert torch.equal(ACTIVATIONS["gelu_tanh"](x[:1]), aten_row)                            # one row
        monkeypatch.setattr(machine, "half_native", lambda dt: True)
        assert torch.equal(ACTIVATIONS["gelu_tanh"](x), aten)                                    # native type
    xg = x.clone().requires_grad_()
    want = "PointwiseBackward" if dtype == torch.bfloat16 else "GeluBackward0"
    assert type(ACTIVATIONS["gelu_tanh"](xg).grad_fn).__name__ == want


@pytest.mark.parametrize("shape", [(12, 64, 512), (2, 5, 33)])   # vector body and scalar tails
def test_bf16_training_activations_round_the_float32_kernel_once(shape):
    """In a bf16 training step (autocast's activations) ReLU² and the tanh GELU take their kernels in bf16:
    widened, computed in float32, rounded once to nearest even. So ReLU² gives ATen's bf16 ops' floats bit
    for bit (relu is exact, and r·r, 2·r·g round once either way), and the tanh GELU is within half a bf16
    step of float64, forward and backward; the exact GELU keeps ATen's bf16 GELU (measured faster)."""
    torch.manual_seed(7)
    x0, g = (torch.randn(*shape) * 3).bfloat16(), torch.randn(*shape).bfloat16()
    x = x0.clone().requires_grad_()
    y = relu_squared(x)
    y.backward(g)
    assert type(y.grad_fn).__name__ == "PointwiseBackward" and y.dtype == x.grad.dtype == torch.bfloat16
    r = torch.relu(x0)
    assert torch.equal(y, r * r) and torch.equal(x.grad, torch.mul(g, r).mul_(2.0))
    x = x0.clone().requires_grad_()
    y = gelu_tanh(x)
    y.backward(g)
    xd = x0.double().requires_grad_()
    ref = F.gelu(xd, approximate="tanh")
    ref.backward(g.double())
    # half a bf16 step (relative) for the one rounding, plus the float32 kernel's own error (within 4e-6 of
    # the formula: test_gelu_tanh_and_its_derivative_match_float64)
    tol = 2.0 ** -8 + 1e-5
    assert type(y.grad_fn).__name__ == "PointwiseBackward" and x.grad.dtype == torch.bfloat16
    assert bool(((y.double() - ref).abs() <= tol * ref.abs() + 1e-6).all())
    assert bool(((x.grad.double() - xd.grad).abs() <= tol * xd.grad.abs() + 1e-5).all())
    assert type(gelu(x0.clone().requires_grad_()).grad_fn).__name__ == "GeluBackward0"


# ---------------------------------------------------------------- GELU, exact (erf) form
@pytest.mark.parametrize("shape", [(12, 64, 512), (3, 7), (1,), (2, 5, 33)])   # vector body and scalar tails
def test_exact_gelu_and_its_saved_derivative_match_float64(shape):
    """Tolerances: Φ within 3.5e-7 (the A&S erf's own error, 1.5e-7, plus its evaluation in float32; ATen's
    float32 GELU, the same formula, measured 2.7e-7 here), so y within 3.5e-7·|x| and a float32 rounding;
    the derivative Φ + xφ within 5e-7 (ATen's backward: 2.6e-7)."""
    x = _inputs(shape, len(shape)).requires_grad_()
    g = torch.randn(*shape)
    y = gelu(x)
    assert type(y.grad_fn).__name__ == "GeluErfBackward"
    (dx,) = torch.autograd.grad(y, x, g)
    xd = x.detach().double()
    cdf = 0.5 * torch.special.erfc(-xd / 2 ** 0.5)
    yd = xd * cdf
    dydx = cdf + xd * torch.exp(-0.5 * xd * xd) / (2 * torch.pi) ** 0.5
    assert ((y.double() - yd).abs() <= 3.5e-7 * xd.abs() + 1.2e-7 * yd.abs() + 1e-30).all()
    assert ((dx.double() - dydx * g.double()).abs() <= 5e-7 * g.double().abs() * (1 + 1.2e-7) + 1e-30).all()
    assert (y - F.gelu(x.detach())).abs().max() < 4e-6                 # and PyTorch's own float32 value
    assert torch.isfinite(dx).all()


def test_exact_gelu_on_a_non_contiguous_input_and_not_twice_differentiable():
    x = torch.randn(8, 6).t().requires_grad_()                        # a transposed view
    gelu(x).sum().backward()
    xd = x.detach().double().requires_grad_()
    F.gelu(xd).sum().backward()
    assert torch.allclose(x.grad.double(), xd.grad, atol=1e-6, rtol=0)
    x64 = torch.randn(3, dtype=torch.float64, requires_grad=True)     # other dtypes keep F.gelu
    assert type(gelu(x64).grad_fn).__name__ == "GeluBackward0"


# ---------------------------------------------------------------- subnormal floats
def _subnormal(t: torch.Tensor) -> int:
    return int(((t.abs() < torch.finfo(torch.float32).tiny) & (t != 0)).sum())


def test_large_inputs_leave_no_subnormal_float_and_the_caller_s_float_mode_as_it_was():
    """Past |x| ~ 9-13 the GELUs' formulas underflow (e^(-x²/2), e·s(1 - s)) into subnormal floats, each
    a microcode assist of ~100+ cycles on x86; measured on a Xeon at 768 x 512, standard deviation 8, one
    thread: the exact GELU 2,859 µs against 302 with them flushed. The kernels flush them to zero
    (ops/flush_denormal.h): before that, inputs of standard deviation 20 gave 100,903 subnormal values
    from the exact GELU and 240 from the tanh form's backward. Values still match float64 (what a flush
    changes is below 1.2e-38), and the calling thread's own float mode is put back."""
    torch.manual_seed(0)
    x = torch.randn(768, 512) * 20
    g = torch.randn(768, 512)
    op = activation_cpu.load()
    y, d = op.gelu_and_grad(x)
    t = op.gelu_tanh(x)
    dt = op.gelu_tanh_backward(g, x)
    assert _subnormal(y) == _subnormal(d) == _subnormal(t) == _subnormal(dt) == 0
    xd = x.double()
    cdf = 0.5 * torch.special.erfc(-xd / 2 ** 0.5)
    assert ((y.double() - xd * cdf).abs() <= 3.5e-7 * xd.abs() + 1e-30).all()
    assert ((d.double() - cdf - xd * torch.exp(-0.5 * xd * xd) / (2 * torch.pi) ** 0.5).abs() <= 5e-7 + 1e-30).all()
    ref = F.gelu(xd, approximate="tanh")
    assert (t.double() - ref).abs().max() < 4e-6                                 # as for unit-scale inputs above
    big = ref.abs() > 1e-2
    assert ((t.double() - ref)[big] / ref[big]).abs().max() < 1e-6
    half_tiny = torch.tensor([torch.finfo(torch.float32).tiny]) * 0.5           # PyTorch's own op, this thread
    assert _subnormal(half_tiny) == 1
