"""ReLU(x)² for training on a CPU: one pass forward, one backward (``relu2_cpu.cpp``), as an autograd
function; :func:`tformer.nn.feed_forward.relu_squared` uses it where :func:`serves` holds.

Forward ``y = max(x, 0)²``; backward ``dx = 2·max(x, 0)·g`` from the saved input. The tests hold both
to the formula in float64. Where the library cannot be built (no compiler, no AVX2; :data:`STATUS`
says why) the caller keeps its PyTorch form.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from tformer.extensions import build_once, compile_library

Tensor = torch.Tensor
SOURCE = Path(__file__).with_name("relu2_cpu.cpp")
STATUS: dict[str, str] = {}           # "state": "built" | "unavailable: <why>" (after the first load())
_LOCK = threading.Lock()
_OP: list = []


def _build():
    op = compile_library("tformer_relu2", [SOURCE], [], "the CPU ReLU² kernel", needs={"avx2", "fma"})

    @torch.library.register_fake("tformer_relu2::relu2")
    def _shape(x):                                        # lets torch.compile trace through the op
        return torch.empty_like(x)

    @torch.library.register_fake("tformer_relu2::relu2_backward")
    def _backward_shape(g, x):
        return torch.empty_like(x)
    return op


def load():
    """The ``torch.ops.tformer_relu2`` namespace, building it the first time; ``None`` when it cannot
    be built here (the reason is in ``STATUS["state"]``)."""
    return build_once(_build, _OP, _LOCK, STATUS)


def serves(x: Tensor) -> bool:
    """Whether the kernel takes ``x``: float32 on the CPU (made contiguous if it is not), the library built."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and load() is not None


class ReLUSquared(torch.autograd.Function):
    """``max(x, 0)²`` by the kernel, saving ``x``; not twice differentiable (nothing in tformer asks)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        x = x.contiguous()
        ctx.save_for_backward(x)
        return load().relu2(x)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return load().relu2_backward(g.contiguous(), x)
