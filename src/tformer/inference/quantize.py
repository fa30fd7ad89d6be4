"""Int8 weight-only quantisation of the linear layers, with one scale per output channel.

Decoding one token reads every weight once, so it is bound by memory bandwidth: storing weights
in 1 byte instead of 4 cuts what each token reads by 4x. Each output row ``j`` of a weight gets
its own scale ``s_j = max_k |W_jk| / 127`` and ``Q_jk = round(W_jk / s_j)`` in [-127, 127]; the
layer computes ``y = (x Qᵀ) · s + b``. Activations stay in floating point ("weight-only"), so the
only error is the rounding of each weight to its row's grid (at most ``s_j / 2``).

Kernel: PyTorch's ``aten._weight_int8pack_mm`` (int8 weights, per-channel scales). For one row on
this CPU it read 22-29 GB/s of int8 weights with bfloat16 activations, but 2-3 GB/s with float32
and ~1.2 GB/s with float16 ones (measured on the GPT-2 shapes), so the input is cast to bfloat16
for the matmul and the result cast back to the model's dtype.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tformer.errors import ConfigError

Tensor = torch.Tensor

KERNEL_DTYPE = torch.bfloat16   # activation dtype of the int8 kernel


def quantize_weight(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-output-channel int8.

    Args:
        weight: ``(N, K)`` float weight.
    Returns:
        ``(q (N, K) int8, scales (N,) float32)`` with ``weight ≈ q * scales[:, None]``.
    """
    w = weight.detach().float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0                       # (N,)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


class Int8Linear(nn.Module):
    """A drop-in for ``nn.Linear`` holding int8 weights and per-channel scales.

    Args:
        linear: the float layer to quantise (its bias is kept in floating point).
    """

    inference_only = True  # int8 weights and scales: tformer.checkpoint refuses to save it

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scales = quantize_weight(linear.weight)
        self.register_buffer("weight", q)                                       # (N, K) int8
        self.register_buffer("scales", scales.to(KERNEL_DTYPE))                 # (N,)
        bias = linear.bias.detach().clone() if linear.bias is not None else None
        self.register_buffer("bias", bias)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).to(KERNEL_DTYPE)                   # (M, K)
        y = torch.ops.aten._weight_int8pack_mm(x2, self.weight, self.scales)    # (M, N)
        y = y.to(x.dtype).view(*shape[:-1], self.out_features)
        return y + self.bias.to(x.dtype) if self.bias is not None else y

    def dequantized(self) -> Tensor:
        """The float weight this layer effectively uses, ``(N, K)`` float32."""
        return self.weight.float() * self.scales.float()[:, None]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


def quantize_int8(model: nn.Module) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` by an :class:`Int8Linear`, in place.

    A tied LM head becomes its own int8 copy; the token embedding keeps its float table (only one
    row of it is read per token).

    Returns:
        the same model.
    """
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            # The kernel returns garbage (or crashes) unless in_features is a multiple of 16
            # (measured with torch 2.13: K = 8 NaN, 24 and 72 wrong, 4 segfaults); such a layer
            # (Mamba's dt_proj, in_features = dt_rank) stays in float.
            if isinstance(child, nn.Linear) and child.in_features % 16 == 0:
                setattr(module, child_name, Int8Linear(child))
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of weight one decode step reads: every linear layer (weight, scales, bias; a tied
    matrix once) and norm. Embedding lookups read one row and are left out (negligible)."""
    seen, total = set(), 0
    for m in model.modules():
        if isinstance(m, (nn.Linear, Int8Linear, DecodeLinear, nn.LayerNorm)) or type(m).__name__ == "RMSNorm":
            for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)):
                if t is not None and t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    total += t.nbytes
    return total


class DecodeLinear(nn.Module):
    """``nn.Linear`` for inference, with the weight in the layout whose kernel reads it fastest.

    Measured for one row ``x`` on the GPT-2 shapes, on this project's 2-core AVX-512 machine (and
    end to end in benchmarks/generate.py, rows "F.linear"): float32 is fastest as ``x @ Wᵀ`` with ``Wᵀ`` stored contiguous ``(K, N)`` (``torch.mm``/
    ``addmm``, ~10-30% over ``F.linear``); bfloat16 as ``torch.mv(W, x)`` for one row (~1.4x
    ``F.linear``) and ``F.linear`` for several; float16 as ``F.linear`` (its ``mv`` is ~3x slower).
    Same numbers, different kernels.

    Args:
        linear: the layer to wrap (its weight is copied only when transposed).
    """

    inference_only = True  # its weight layout is not nn.Linear's: tformer.checkpoint refuses to save it

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()
        self.transposed = w.dtype == torch.float32
        self.register_buffer("weight", w.t().contiguous() if self.transposed else w)   # (K, N) | (N, K)
        self.register_buffer("bias", linear.bias.detach() if linear.bias is not None else None)

    def forward(self, x: Tensor) -> Tensor:
        x2 = x.reshape(-1, self.in_features)                                      # (M, K)
        if self.transposed:
            y = torch.mm(x2, self.weight) if self.bias is None else torch.addmm(self.bias, x2, self.weight)
        elif x2.shape[0] == 1 and self.weight.dtype == torch.bfloat16:
            y = torch.mv(self.weight, x2[0]).unsqueeze(0)
            y = y if self.bias is None else y + self.bias
        else:
            y = torch.nn.functional.linear(x2, self.weight, self.bias)
        return y.view(*x.shape[:-1], self.out_features)


def use_decode_kernels(model: nn.Module) -> nn.Module:
    """Replace every ``nn.Linear`` by a :class:`DecodeLinear`, in place; returns the model."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, DecodeLinear(child))
    return model


PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.bfloat16}


def set_precision(model: nn.Module, precision: str, decode_kernels: bool = True) -> nn.Module:
    """Cast ``model`` for inference, in place: ``fp32``, ``bf16``, ``fp16``, or ``int8`` (int8
    weight-only linear layers, everything else in bfloat16, the int8 kernel's activation dtype).

    Args:
        decode_kernels: float linears become :class:`DecodeLinear` (faster one-row kernels).
    Raises:
        ValueError: for an unknown precision.
    """
    if precision not in PRECISIONS:
        raise ConfigError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}.")
    model.to(PRECISIONS[precision])
    if precision == "int8":
        quantize_int8(model)
    elif decode_kernels:
        use_decode_kernels(model)
    return model
