"""Int8 weight-only quantisation of the linear layers, with one scale per output channel.

Decoding one token reads every weight once, so it is bound by memory bandwidth: storing weights
in 1 byte instead of 4 cuts what each token reads by 4x. Each output row ``j`` of a weight gets
its own scale ``s_j = max_k |W_jk| / 127`` and ``Q_jk = round(W_jk / s_j)`` in [-127, 127]; the
layer computes ``y = (x Qᵀ) · s + b``. Activations stay in floating point ("weight-only"), so the
only error is the rounding of each weight to its row's grid (at most ``s_j / 2``).

Kernels: PyTorch's ``aten._weight_int8pack_mm`` (int8 weights, per-channel scales) is fast with bfloat16
activations only (with float32 or float16 ones it measured many times slower:
docs/inference.md#lower-precision-and-the-kernels-behind-it), so the input is cast to bfloat16 and the result
cast back. For one row (decode) the kernel is chosen by measuring on the machine
(:func:`tformer.quant.kernels.choose`): that or tformer's own loop (``gemv.cpp``, AVX-512 or AVX2), which
widens the int8 weights to float32 and applies the same scales.

Int4 (:class:`Int4Linear`) is weight-only too, in groups of 32 weights along K with a scale and an
offset per group (asymmetric, 16 levels from the group's min to its max), run by torch's
``aten._weight_int4pack_mm_for_cpu`` or, for one row when measured faster, tformer's ``gemv_q4``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tformer.errors import ConfigError
from tformer.quant import gemv, kernels
from tformer.quant.block_linear import BlockLinear, quantize_blocks

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
        kernel: force the one-row kernel, ``int8pack`` or ``ext`` (default: the measured choice).
    """

    inference_only = True  # int8 weights and scales: tformer.checkpoint refuses to save it

    def __init__(self, linear: nn.Linear, kernel: str | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scales = quantize_weight(linear.weight)
        self.register_buffer("weight", q)                                       # (N, K) int8
        self.register_buffer("scales", scales.to(KERNEL_DTYPE))                 # (N,)
        bias = linear.bias.detach().clone() if linear.bias is not None else None
        self.register_buffer("bias", bias)
        self.kernel = kernel or kernels.choose("int8", decode_layer)                           # for one row
        self.gemv = gemv.load() if self.kernel == "ext" else None
        # the ext kernel takes float32 scales and bias: the same values as the bf16 ones above
        self.register_buffer("scales32", self.scales.float(), persistent=False)
        self.register_buffer("bias32", bias.float() if bias is not None else None, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).to(KERNEL_DTYPE).contiguous()      # (M, K); the kernels need rows packed
        if self.gemv is not None and x2.shape[0] == 1:
            y = self.gemv(self.weight, x2[0], self.scales32, self.bias32)       # (N,) bias included
            return y.to(x.dtype).view(*shape[:-1], self.out_features)
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
            if isinstance(child, nn.Linear) and child.in_features % QUANT_WIDTH["int8"] == 0:
                setattr(module, child_name, Int8Linear(child))
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of weight one decode step reads: every linear layer (weight, scales, bias; a tied
    matrix once) and norm. Embedding lookups read one row and are left out (negligible)."""
    seen, total = set(), 0
    for m in model.modules():
        if isinstance(m, (nn.Linear, Int8Linear, Int4Linear, DecodeLinear, BlockLinear, nn.LayerNorm)) or type(m).__name__ == "RMSNorm":
            skip = m._non_persistent_buffers_set                  # float32 copies of scales / bias
            tensors = m.decode_tensors() if hasattr(m, "decode_tensors") else \
                list(m.parameters(recurse=False)) + [b for n, b in m.named_buffers(recurse=False) if n not in skip]
            for t in tensors:
                if t is not None and t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    total += t.nbytes
    return total


class DecodeLinear(nn.Module):
    """``nn.Linear`` for inference, with the weight in the layout of the kernel that reads it fastest.

    For one row (a decode step) the kernel is the one :func:`tformer.quant.kernels.choose`
    measured fastest for the weight's dtype on this machine: ``F.linear``, ``torch.mv``, ``x @ Wᵀ``
    with ``Wᵀ`` stored ``(K, N)`` (float32), or tformer's own loop (``ext``, AVX-512 or AVX2). Several
    rows (the prefill) run ``F.linear`` (``addmm`` on ``Wᵀ`` for ``mm_t``), at bf16 / fp16 in that dtype,
    widened to float32 for the product, or tformer's several-row tiles (``gemv.cpp``), whichever
    :func:`tformer.quant.kernels.choose_prefill` measured fastest here (under autograd ``F.linear``). Same numbers up to the float32
    summation order and the final rounding, different kernels.

    Args:
        linear: the layer to wrap (its weight is copied only when transposed).
        kernel: force a kernel (default: the measured choice).
    """

    inference_only = True  # its weight layout is not nn.Linear's: tformer.checkpoint refuses to save it

    def __init__(self, linear: nn.Linear, kernel: str | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()
        kind = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(w.dtype)
        self.kernel = kernel or (kernels.choose(kind, decode_layer) if kind else "linear")
        self.transposed = self.kernel == "mm_t"
        self.prefill = kernels.choose_prefill(kind) if kind else "native"             # for several rows
        self.gemv = gemv.load() if self.kernel == "ext" else None
        if self.kernel == "ext" and self.gemv is None:
            self.kernel = "linear"
        self.register_buffer("weight", w.t().contiguous() if self.transposed else w)   # (K, N) | (N, K)
        self.register_buffer("bias", linear.bias.detach() if linear.bias is not None else None)
        self.register_buffer("bias32", self.bias.float() if self.bias is not None else None, persistent=False)

    def row_major(self) -> Tensor:
        """The weight as ``(N, K)`` rows, for a reader of rows (the fused decode layer): a weight
        stored transposed for ``torch.mm`` is laid back in place (no second copy kept) and the layer
        then runs ``F.linear``. Laid back outside ``inference_mode`` (often on at the first decode), so
        the module can still run under autograd after."""
        if self.transposed:
            with torch.inference_mode(False):
                self.weight = self.weight.t().contiguous()
            self.transposed, self.kernel = False, "linear"
        return self.weight

    def forward(self, x: Tensor) -> Tensor:
        x2 = x.reshape(-1, self.in_features)                                      # (M, K)
        if self.transposed:
            y = torch.mm(x2, self.weight) if self.bias is None else torch.addmm(self.bias, x2, self.weight)
        elif x2.shape[0] == 1 and self.gemv is not None and not (x2.requires_grad and torch.is_grad_enabled()):
            y = self.gemv(self.weight, x2[0], None, self.bias32).unsqueeze(0)     # (1, N); the ext loop has no backward
        elif x2.shape[0] == 1 and self.kernel == "mv":
            y = torch.mv(self.weight, x2[0]).unsqueeze(0)
            y = y if self.bias is None else y + self.bias
        elif self.prefill != "native" and x2.shape[0] > 1 and not (x2.requires_grad and torch.is_grad_enabled()):
            y = kernels.prefill_product(self.prefill, x2, self.weight, self.bias)   # widened, or tformer's tiles
        else:
            y = torch.nn.functional.linear(x2, self.weight, self.bias)
        return y.view(*x.shape[:-1], self.out_features)


def quantize_weight_int4(weight: Tensor, group: int = 32) -> tuple[Tensor, Tensor]:
    """Asymmetric int4 per group of ``group`` weights along K (see :class:`Int4Linear`).

    Args:
        weight: ``(N, K)`` float, ``K`` a multiple of ``group``.
    Returns:
        ``(q (Np, K) int32 in [0, 15], scales_zeros (K/group, Np, 2) bfloat16)``, ``Np`` = N rounded
        up to 16 (zero rows), with ``W[n, k] ≈ (q[n, k] - 8) · s[g, n] + z[g, n]``, ``g = k // group``.
    """
    N, K = weight.shape
    Np = -(-N // 16) * 16
    w = torch.zeros(Np, K)
    w[:N] = weight.detach().float()
    wg = w.view(Np, K // group, group)                                              # (Np, G, group)
    lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    s = ((hi - lo) / 15).clamp(min=1e-8)
    q = torch.round((wg - lo) / s).clamp(0, 15).to(torch.int32).view(Np, K)
    sz = torch.stack([s.view(Np, -1), (lo + 8 * s).view(Np, -1)], -1)             # (Np, G, 2)
    return q, sz.transpose(0, 1).contiguous().to(KERNEL_DTYPE)


class Int4Linear(nn.Module):
    """Weight-only int4 ``nn.Linear``: groups of ``group`` weights along K, each with its own scale
    and offset, run by ``aten._weight_int4pack_mm_for_cpu`` (bfloat16 activations).

    Per group ``g`` of one row: ``lo = min W_g``, ``s = (max W_g - lo) / 15``, ``q = round((W_g - lo) / s)``
    in [0, 15]; torch's kernel computes ``W ≈ (q - 8) · s + z`` with ``z = lo + 8 s`` (both stored in
    bfloat16). The error per weight is at most ``s / 2`` plus the bfloat16 rounding of ``s`` and ``z``.
    Output rows are padded to a multiple of 16 (the kernel's tile) and cut back.

    Args:
        linear: the float layer (``in_features`` a multiple of ``group``).
        group: weights per scale (32, as llama.cpp's q4_0 blocks).
        kernel: force the one-row kernel, ``int4pack`` or ``ext`` (default: the measured choice).
    """

    inference_only = True

    def __init__(self, linear: nn.Linear, group: int = 32, kernel: str | None = None):
        super().__init__()
        self.in_features, self.out_features, self.group = linear.in_features, linear.out_features, group
        q, sz = quantize_weight_int4(linear.weight, group)
        self.register_buffer("weight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        self.register_buffer("scales_zeros", sz)                                   # (G, Np, 2) bf16
        bias = linear.bias.detach().clone() if linear.bias is not None else None
        self.register_buffer("bias", bias)
        self.kernel = kernel or (kernels.choose("int4", decode_layer) if group == 32 else "int4pack")   # for one row
        self.gemv = gemv.load_q4() if self.kernel == "ext" else None
        if self.gemv is not None:                                                 # the same q, s, z in gemv_q4's layout
            N = self.out_features
            s, z = sz[..., 0].float().t()[:N], sz[..., 1].float().t()[:N]           # (N, G)
            self.register_buffer("packed", gemv.pack_int4(q[:N]), persistent=False)        # (N, K/2) uint8
            self.register_buffer("scales32", s.contiguous(), persistent=False)
            self.register_buffer("offsets32", (z - 8 * s).contiguous(), persistent=False)  # w = q s + (z - 8 s)
            self.register_buffer("bias32", bias.float() if bias is not None else None, persistent=False)

    def decode_tensors(self) -> list[Tensor]:
        """What a one-row (decode) call reads: for :func:`weight_bytes`."""
        if self.gemv is not None:
            return [t for t in (self.packed, self.scales32, self.offsets32, self.bias32) if t is not None]
        return [t for t in (self.weight, self.scales_zeros, self.bias) if t is not None]

    def forward(self, x: Tensor) -> Tensor:
        x2 = x.reshape(-1, self.in_features).to(KERNEL_DTYPE).contiguous()         # (M, K); the kernels need rows packed
        if self.gemv is not None and x2.shape[0] == 1:
            y = self.gemv(self.packed, x2[0], self.scales32, self.offsets32, self.bias32)   # (N,) bias included
            return y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.weight, self.group, self.scales_zeros)  # (M, Np)
        y = y[:, :self.out_features].to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y + self.bias.to(x.dtype) if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 groups of {self.group}"


def quantize_int4(model: nn.Module, group: int = 32) -> nn.Module:
    """Replace every ``nn.Linear`` whose ``in_features`` is a multiple of ``group`` by an
    :class:`Int4Linear`, in place (others stay in float); returns the model."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child.in_features % group == 0:
                setattr(module, name, Int4Linear(child, group))
    return model


QUANT_WIDTH = {"int8": 16, "int4": 32}   # in_features must be a multiple of this for the kernel
QUANT_WIDTH.update({"q8_0": 32, "q4_0": 32, "q4_1": 32})   # GGUF blocks of 32 (BlockLinear)


def float_linears(model: nn.Module) -> tuple[list[str], int]:
    """After ``set_precision(model, "int8" | "int4" | "q8_0" | "q4_0" | "q4_1")``: the names of the linear layers it left in
    floating point (their ``in_features`` is not a multiple of :data:`QUANT_WIDTH`), and how many
    linear layers there are in all."""
    left, total = [], 0
    for name, m in model.named_modules():
        if isinstance(m, (nn.Linear, Int8Linear, Int4Linear, BlockLinear)):
            total += 1
            if isinstance(m, nn.Linear):
                left.append(name)
    return left, total


def use_decode_kernels(model: nn.Module) -> nn.Module:
    """Replace every ``nn.Linear`` by a :class:`DecodeLinear`, in place; returns the model."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, DecodeLinear(child))
    return model


# The weight formats :func:`set_precision` casts a model to (``--dtype``) -> the dtype of the model's other tensors.
# Not training's autocast modes (tformer.training.config.AUTOCAST_MODES).
WEIGHT_FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.bfloat16,
                  "int4": torch.bfloat16}
# GGUF block formats (tformer.quant.block_linear): the rest of the model stays float32, as llama.cpp's activations
BLOCK_FORMATS = {"q8_0": torch.float32, "q4_0": torch.float32, "q4_1": torch.float32}
WEIGHT_FORMATS.update(BLOCK_FORMATS)


def set_precision(model: nn.Module, precision: str, decode_kernels: bool = True) -> nn.Module:
    """Cast ``model`` for inference, in place: ``fp32``, ``bf16``, ``fp16``, ``int8`` or ``int4``
    (weight-only int8 / int4 linear layers, everything else in bfloat16, their kernels' activation dtype),
    or a GGUF block format ``q8_0`` / ``q4_0`` / ``q4_1`` (:class:`BlockLinear` layers: integer block
    products with the activations quantised to 8 bits per block of 32; everything else in float32).

    Args:
        decode_kernels: float linears become :class:`DecodeLinear` (faster one-row kernels).
    Raises:
        ConfigError: an unknown precision.
    """
    if precision not in WEIGHT_FORMATS:
        raise ConfigError(f"unknown precision {precision!r}; choose one of {', '.join(WEIGHT_FORMATS)}.")
    model.to(WEIGHT_FORMATS[precision])
    if precision == "int8":
        quantize_int8(model)
    elif precision == "int4":
        quantize_int4(model)
    elif precision in BLOCK_FORMATS:
        quantize_blocks(model, precision)
    elif decode_kernels:
        use_decode_kernels(model)
    return model


def decode_layer(kind: str, kernel: str, linear: torch.nn.Linear) -> torch.nn.Module:
    """The inference layer tformer decodes with for ``kind`` (:class:`DecodeLinear`, :class:`Int8Linear`
    or :class:`Int4Linear` of ``linear``), with ``kernel`` forced: what :func:`tformer.quant.kernels.measure` times."""
    if kind == "int8":
        return Int8Linear(linear, kernel=kernel)
    if kind == "int4":
        return Int4Linear(linear, kernel=kernel)
    return DecodeLinear(linear.to(kernels.DTYPES[kind]), kernel=kernel)
