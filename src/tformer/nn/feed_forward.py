"""The position-wise feed-forward sub-layer: each token "thinks alone" after the mixer let tokens talk.

Two kinds: the classic MLP ``down(act(up(x)))`` with ``d_ff = 4·d`` (Vaswani et al.; GPT-2), and the
gated SwiGLU ``down(silu(gate(x)) * up(x))`` (Shazeer, 2020; Llama). The output projection writes
into the residual stream, so it is marked for the scaled initialisation.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tformer.config import TransformerConfig
from tformer.machine import emulates_half
from tformer.nn.markers import mark_residual
from tformer.ops import activation_cpu

Tensor = torch.Tensor


class _ReLUSquared(torch.autograd.Function):
    """``r = relu(x)``, ``y = r·r``; backward ``g·2r`` from the saved ``r``: four passes over the
    activation in all, where ``F.relu(x).square()`` under autograd takes about eight (``pow`` and its generic
    backward, then ``threshold_backward``); a training step's activation is cold, so each pass saved is time
    (measured: docs/training.md#how-the-cpu-training-step-is-made-fast). Not twice differentiable (``r`` is
    saved detached): nothing in tformer asks for it."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        r = torch.relu(x)
        ctx.save_for_backward(r)
        return r * r

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor) -> Tensor:
        (r,) = ctx.saved_tensors
        return torch.mul(g, r).mul_(2.0)                     # the second pass in place, on what is in cache


def relu_squared(x: Tensor) -> Tensor:
    """ReLU(x)² (So et al., 2021, "Primer"): zero for x < 0, x² above; its derivative 2·ReLU(x) is
    continuous, unlike ReLU's step, and it is sparse like ReLU. float32 on a CPU takes tformer's kernel
    (one pass each way; the same floats bit for bit, since ×2 is exact), which measured faster in whole
    training steps than the four passes of :class:`_ReLUSquared` (benchmarks/training/cpu_kernels.py;
    figures: docs/training.md#how-the-cpu-training-step-is-made-fast)."""
    if activation_cpu.serves(x, "relu2"):
        return activation_cpu.Pointwise.apply(x, "relu2")
    return _ReLUSquared.apply(x)


class _SiluGate(torch.autograd.Function):
    """``h = silu(g)·u`` keeping only ``g`` and ``u`` for the backward, where autograd on the expression keeps
    ``silu(g)`` too (a third ``(…, d_ff)`` tensor per block): the backward computes ``s = silu(g)`` again,

        ∂L/∂u = ∂L/∂h · s        ∂L/∂g = silu'(g) · (∂L/∂h · u)       silu'(g) = σ(g)(1 + g(1 − σ(g)))

    with the ops autograd runs for the expression (``mul``, ``silu_backward``), so the gradients are the same
    floats. One more pass over ``g`` in the backward. Not twice differentiable."""

    @staticmethod
    def forward(ctx, g: Tensor, u: Tensor) -> Tensor:
        ctx.save_for_backward(g, u)
        return F.silu(g) * u

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        g, u = ctx.saved_tensors
        gg = torch.ops.aten.silu_backward(grad * u, g) if ctx.needs_input_grad[0] else None
        gu = grad * F.silu(g) if ctx.needs_input_grad[1] else None
        return gg, gu


def silu_gate(g: Tensor, u: Tensor) -> Tensor:
    """SwiGLU's gated product ``silu(g) · u`` (both ``(…, d_ff)``); in training :class:`_SiluGate`, which keeps
    a third less for the backward."""
    if torch.is_grad_enabled() and (g.requires_grad or u.requires_grad) and g.shape == u.shape:
        return _SiluGate.apply(g, u)
    return F.silu(g) * u


def gelu_tanh(x: Tensor) -> Tensor:
    """GELU's tanh form (GPT-2's): on a CPU in float32 tformer's kernel (one pass each way;
    :mod:`tformer.ops.activation_cpu`), elsewhere ``F.gelu(x, approximate="tanh")``. Inference takes the
    kernel too: on a prompt's activation ATen's tanh form measured several times slower than one pass
    (docs/inference.md#speed-against-llamacpp-and-hf-in-the-same-run). Its values are within 4e-6 of PyTorch's
    (tests), under the tolerance every interop test holds."""
    training = x.requires_grad and torch.is_grad_enabled()
    if activation_cpu.serves(x, "gelu_tanh"):
        return activation_cpu.Pointwise.apply(x, "gelu_tanh") if training else activation_cpu.load().gelu_tanh(x.contiguous())
    if not training and x.numel() > x.shape[-1] and emulates_half(x) and activation_cpu.load() is not None:
        # a 16-bit prompt (several rows; a decode step keeps ATen's, as attention does) on a CPU that emulates
        # the type: ATen's emulated 16-bit GELU measured slower than the float32 kernel on the widened
        # activation, rounded once as ATen's is (docs/inference.md#speed-against-llamacpp-and-hf-in-the-same-run)
        return activation_cpu.load().gelu_tanh(x.float()).to(x.dtype)
    return F.gelu(x, approximate="tanh")


def gelu(x: Tensor) -> Tensor:
    """The exact (erf) GELU, ``x·Φ(x)``: in a float32 CPU training step tformer's kernel (the forward
    also writes the derivative, so the backward is one multiply: :class:`~tformer.ops.activation_cpu.GeluErf`),
    elsewhere ``F.gelu``."""
    if x.requires_grad and torch.is_grad_enabled() and activation_cpu.serves(x, "gelu"):
        return activation_cpu.GeluErf.apply(x)
    return F.gelu(x)


ACTIVATIONS = {
    "gelu": lambda x: gelu(x),                        # exact erf form (BERT, Vaswani-era GELU; nanoGPT's)
    "gelu_tanh": lambda x: gelu_tanh(x),              # GPT-2's approximation (the CPU kernel in training)
    "relu": F.relu,
    "silu": F.silu,
    "relu2": lambda x: relu_squared(x),
}


class MLP(nn.Module):
    """Position-wise feed-forward: Linear(d, d_ff) -> activation -> Linear(d_ff, d) -> dropout."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.up = nn.Linear(config.d_model, config.d_ff, bias=config.bias)
        self.down = mark_residual(nn.Linear(config.d_ff, config.d_model, bias=config.bias))
        self.act = ACTIVATIONS[config.activation]

    def forward(self, x: Tensor) -> Tensor:
        return self.down(self.act(self.up(x)))

    def hooked(self, x: Tensor, hook, prefix: str) -> Tensor:
        """:meth:`forward` through the hook points ``hook_pre`` (``up(x)``) and ``hook_post`` (after the
        activation), both ``(B, T, d_ff)``; ``hook(name, t)`` may return a replacement."""
        post = hook(prefix + "hook_post", self.act(hook(prefix + "hook_pre", self.up(x))))
        return self.down(post)


class SwiGLU(nn.Module):
    """Gated feed-forward (Shazeer, 2020; Llama): down(silu(gate(x)) * up(x)).

    Three matrices instead of two, so d_ff ≈ 8/3 · d keeps the parameter count of a 4d MLP.
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.gate = nn.Linear(config.d_model, config.d_ff, bias=config.bias)
        self.up = nn.Linear(config.d_model, config.d_ff, bias=config.bias)
        self.down = mark_residual(nn.Linear(config.d_ff, config.d_model, bias=config.bias))
        self.act = F.silu                              # the gate's activation (GeGLU: GELU)

    def forward(self, x: Tensor) -> Tensor:
        if self.act is F.silu:                         # silu recomputed in the backward, not kept (_SiluGate)
            return self.down(silu_gate(self.gate(x), self.up(x)))
        return self.down(self.act(self.gate(x)) * self.up(x))

    def hooked(self, x: Tensor, hook, prefix: str) -> Tensor:
        """:meth:`forward` through the hook points ``hook_pre`` (``gate(x)``), ``hook_pre_linear``
        (``up(x)``) and ``hook_post`` (their gated product), all ``(B, T, d_ff)``."""
        pre = hook(prefix + "hook_pre", self.gate(x))
        post = hook(prefix + "hook_post", self.act(pre) * hook(prefix + "hook_pre_linear", self.up(x)))
        return self.down(post)


class GeGLU(SwiGLU):
    """Gated feed-forward with GELU (Shazeer, 2020; Gemma with GELU's tanh form): down(act(gate(x)) * up(x)),
    ``act`` the config's ``activation`` (``gelu`` or ``gelu_tanh``). The same matrices as :class:`SwiGLU`."""

    def __init__(self, config: TransformerConfig):
        super().__init__(config)
        self.act = ACTIVATIONS[config.activation]      # forward and hooked are SwiGLU's, with this gate


def make_feed_forward(config: TransformerConfig) -> nn.Module | None:
    """The block's feed-forward per ``config.ffn``; ``None`` for ``ffn="none"`` (Mamba-style stacks,
    where the mixer is the whole layer)."""
    kinds = {"mlp": MLP, "swiglu": SwiGLU, "geglu": GeGLU}
    return kinds[config.ffn](config) if config.ffn in kinds else None
