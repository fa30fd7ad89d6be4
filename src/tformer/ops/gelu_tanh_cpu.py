"""GELU's tanh form (GPT-2's) for training on a CPU: one pass forward, one backward
(``gelu_tanh_cpu.cpp``), as an autograd function; :data:`tformer.nn.feed_forward.ACTIVATIONS` uses it
for ``activation="gelu_tanh"`` where :func:`serves` holds.

``y = x·s`` with ``s = 1/(1 + e^(-2u))`` = ``(1 + tanh u)/2`` and ``u = √(2/π)(x + 0.044715x³)``;
derivative ``s + 2x·s(1-s)·√(2/π)(1 + 3·0.044715x²)``. The tests hold both to PyTorch's formula in
float64 within 1e-6. With torch held to AVX2 (benchmarks/training/cpu_kernels.py, results
cpu_kernels-avx2.md, 2 threads): forward / backward at 768 x 512 172 / 254 µs against ``F.gelu``'s
626 / 712; a 4L/128 training step (``recipe=classic`` with this activation, fp32) 48.6 against 52.3 ms.
The exact erf form keeps ``F.gelu``, whose AVX2 kernel is already one pass of the Abramowitz & Stegun
erf: a kernel for it measured 48.9 against 48.6 ms a step (by hand, 8 alternated blocks of 25 steps). Where the library cannot be built (no compiler, no
AVX2; :data:`STATUS` says why) the caller keeps ``F.gelu``.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from tformer.extensions import build_once, compile_library

Tensor = torch.Tensor
SOURCE = Path(__file__).with_name("gelu_tanh_cpu.cpp")
HEADERS = [SOURCE.with_name("vec_exp.h")]
STATUS: dict[str, str] = {}           # "state": "built" | "unavailable: <why>" (after the first load())
_LOCK = threading.Lock()
_OP: list = []


def _build():
    op = compile_library("tformer_gelu_tanh", [SOURCE], HEADERS, "the CPU tanh-GELU kernel", needs={"avx2", "fma"})

    @torch.library.register_fake("tformer_gelu_tanh::gelu_tanh")
    def _shape(x):                                        # lets torch.compile trace through the op
        return torch.empty_like(x)

    @torch.library.register_fake("tformer_gelu_tanh::gelu_tanh_backward")
    def _backward_shape(g, x):
        return torch.empty_like(x)
    return op


def load():
    """The ``torch.ops.tformer_gelu_tanh`` namespace, building it the first time; ``None`` when it
    cannot be built here (the reason is in ``STATUS["state"]``)."""
    return build_once(_build, _OP, _LOCK, STATUS)


def serves(x: Tensor) -> bool:
    """Whether the kernel takes ``x``: float32 on the CPU under autograd (a training step; inference
    keeps ``F.gelu``, bit for bit what the interop tests compare), the library built."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.requires_grad
            and torch.is_grad_enabled() and load() is not None)


class GELUTanh(torch.autograd.Function):
    """GELU's tanh form by the kernel, saving ``x``. Not twice differentiable (nothing in tformer asks)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        x = x.contiguous()
        ctx.save_for_backward(x)
        return load().gelu_tanh(x)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return load().gelu_tanh_backward(g.contiguous(), x)


def gelu_tanh(x: Tensor) -> Tensor:
    """GELU's tanh form of ``x``: the kernel where :func:`serves` holds, ``F.gelu(x, approximate="tanh")``
    elsewhere."""
    if serves(x):
        return GELUTanh.apply(x)
    return torch.nn.functional.gelu(x, approximate="tanh")
