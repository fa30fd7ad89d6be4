"""MLP activations for training on a CPU, one pass forward and one backward each
(``activation_cpu.cpp``), as one autograd function; :mod:`tformer.nn.feed_forward` uses them where
:func:`serves` holds.

- ``relu2``: ``y = max(x, 0)²``, ``dx = 2·max(x, 0)·g``; the same floats bit for bit as the four-pass
  PyTorch Function it replaces (×2 is exact), so it also serves inference.
- ``gelu_tanh`` (GPT-2's GELU): ``y = x·s``, ``s = 1/(1 + e^(-2u))`` = ``(1 + tanh u)/2``,
  ``u = √(2/π)(x + 0.044715x³)``; ``dx = (s + 2x·s(1-s)·√(2/π)(1 + 3·0.044715x²))·g``, within 1e-6 of
  PyTorch's formula in float64 (the tests). ATen's AVX2 tanh GELU takes several passes each way, so one
  pass measured several times faster, alone and in whole steps (benchmarks/training/cpu_kernels.py). The
  feed-forward layer takes it in inference too (its forward alone).
- ``gelu`` (the exact erf form; training only, :class:`GeluErf`): the forward writes ``y = x·Φ(x)`` and
  its derivative ``Φ(x) + x·φ(x)`` in one pass (the Abramowitz & Stegun erf that ATen's AVX2 kernel also
  evaluates needs ``e^(-x²/2)``, which is ``φ``'s exponential), and saves the derivative instead of ``x``;
  the backward is one multiply instead of ATen's second erf and exponential. Writing ``y`` over ``x`` instead
  (one fresh buffer fewer) measured no faster (docs/training.md#measured-and-not-kept), so it is not done.
  Inference keeps ``F.gelu``.

The figures for all three: docs/training.md#how-the-cpu-training-step-is-made-fast.

In a bf16 training step (autocast's activations) ``relu2`` and ``gelu_tanh`` take bf16 as it is: each
value widened, computed in float32, rounded once to nearest even (``vec_bf16.h``); :func:`serves` has
the measurements. The exact GELU stays float32 (ATen's bf16 GELU measured faster).

Where the library cannot be built (no compiler, no AVX2; :data:`STATUS` says why) the callers keep
their PyTorch forms.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from tformer.extensions import build_once, compile_library

Tensor = torch.Tensor
SOURCE = Path(__file__).with_name("activation_cpu.cpp")
HEADERS = [SOURCE.with_name(h) for h in ("vec_exp.h", "vec_erf.h", "vec_bf16.h", "flush_denormal.h")]
POINTWISE = ("relu2", "gelu_tanh")    # ops x -> y with a backward (g, x) -> dx (:class:`Pointwise`)
NAMES = (*POINTWISE, "gelu")           # and the exact GELU, whose forward also writes dy/dx (:class:`GeluErf`)
STATUS: dict[str, str] = {}           # "state": "built" | "unavailable: <why>" (after the first load())
_LOCK = threading.Lock()
_OP: list = []


def _build():
    op = compile_library("tformer_activation", [SOURCE], HEADERS, "the CPU activation kernels", needs={"avx2", "fma"})
    for name in POINTWISE:                                # let torch.compile trace through the ops
        torch.library.register_fake(f"tformer_activation::{name}")(lambda x: torch.empty_like(x))
        torch.library.register_fake(f"tformer_activation::{name}_backward")(lambda g, x: torch.empty_like(x))
    torch.library.register_fake("tformer_activation::gelu_and_grad")(lambda x: (torch.empty_like(x), torch.empty_like(x)))
    return op


def load():
    """The ``torch.ops.tformer_activation`` namespace, building it the first time; ``None`` when it
    cannot be built here (the reason is in ``STATUS["state"]``)."""
    return build_once(_build, _OP, _LOCK, STATUS)


def serves(x: Tensor, name: str) -> bool:
    """Whether the kernel ``name`` (one of :data:`NAMES`) takes ``x``: float32 on the CPU (made
    contiguous if it is not), or for the :data:`POINTWISE` ones bfloat16 in a training step (autocast's
    activations: widened, computed in float32, rounded once; ReLU² then gives ATen's bf16 floats bit for
    bit), the library built. In whole bf16 steps against ATen's bf16 ops the two pointwise kernels
    measured faster and the exact GELU widened this way slower, so it stays float32
    (docs/training-speed-log.md#issue-26-the-recipes-the-kernels-and-three-machines)."""
    return (name in NAMES and x.device.type == "cpu" and load() is not None
            and (x.dtype == torch.float32
                 or (name in POINTWISE and x.dtype == torch.bfloat16 and x.requires_grad and torch.is_grad_enabled())))


class Pointwise(torch.autograd.Function):
    """``name``'s value by the kernel, saving ``x``; its backward the kernel's derivative times the
    incoming gradient. Not twice differentiable (nothing in tformer asks)."""

    @staticmethod
    def forward(ctx, x: Tensor, name: str) -> Tensor:
        x = x.contiguous()
        ctx.save_for_backward(x)
        ctx.name = name
        return getattr(load(), name)(x)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        (x,) = ctx.saved_tensors
        return getattr(load(), f"{ctx.name}_backward")(g.contiguous(), x), None


class GeluErf(torch.autograd.Function):
    """The exact GELU by the kernel: the forward returns ``y`` and saves ``dy/dx`` (computed in the same
    pass), so the backward is ``g · dy/dx``. Saves one activation-sized tensor, as ``F.gelu`` saves ``x``.
    Not twice differentiable (nothing in tformer asks)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        y, dydx = load().gelu_and_grad(x.contiguous())
        ctx.save_for_backward(dydx)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        (dydx,) = ctx.saved_tensors
        return torch.mul(g, dydx)
