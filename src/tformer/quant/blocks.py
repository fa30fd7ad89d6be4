"""GGUF's block formats Q8_0, Q4_0 and Q4_1, byte for byte as ggml stores them, and the arithmetic
of a product with activations quantised to 8-bit blocks.

A weight row of ``K`` values (``K`` a multiple of 32) is ``K / 32`` blocks of 32 consecutive values,
each stored as a little-endian struct (ggml's ``block_q8_0`` / ``block_q4_0`` / ``block_q4_1``):

==========  =====  ==================================================  ==========================
format      bytes  layout                                              value of element ``j``
==========  =====  ==================================================  ==========================
``q8_0``    34     ``d`` fp16, ``qs[32]`` int8                          ``d · qs[j]``
``q4_0``    18     ``d`` fp16, ``qs[16]`` nibbles                       ``d · (q_j - 8)``
``q4_1``    20     ``d`` fp16, ``m`` fp16, ``qs[16]`` nibbles           ``d · q_j + m``
==========  =====  ==================================================  ==========================

Nibbles: byte ``i`` of ``qs`` holds element ``i`` in its low four bits and element ``i + 16`` in its
high four. A matrix ``(N, K)`` is stored as ``(N, K/32 · bytes)`` uint8, rows after each other: the
same bytes a GGUF tensor holds, so import and export are copies (:func:`quantize` equals
``gguf.quants.quantize`` byte for byte, which tests/quant/test_blocks.py checks).

Rounding (ggml's ``quantize_row_*_ref``, float32 throughout):

- q8_0: ``d = max|x| / 127``, ``q = roundf(x / d)`` (half away from zero) in [-127, 127];
- q4_0: ``M`` = the value of largest magnitude (the first one on ties), ``d = M / -8``,
  ``q = min(15, trunc(x / d + 8.5))``, so ``M`` itself maps to ``q = 0`` (value ``-8 d = M``);
- q4_1: ``d = (max - min) / 15``, ``m = min``, ``q = min(15, trunc((x - m) / d + 0.5))``.

The division is a multiplication by ``id = 1/d`` (0 when ``d = 0``), then ``d`` (and ``m``) are
rounded to fp16 for storage; the fp16 values are the ones every product uses.

Activations (:func:`quantize_activation`) are quantised per product, once per row, to blocks of 32
as ggml's SIMD ``quantize_row_q8_0`` / ``q8_1`` do: ``a = max|x|``, ``dx = a / 127`` and
``q = rne(x · (127 / a))`` (round to nearest even), with ``dx`` kept in float32 (ggml rounds it to
fp16) and the block sum ``Σ q`` kept as an integer. One block's contribution to ``y = W x`` is then
an integer dot product times one float:

- q8_0: ``d · dx · Σ qw qx``;
- q4_0: ``d · dx · (Σ qw qx - 8 Σ qx)``;
- q4_1: ``d · dx · Σ qw qx + m · dx · Σ qx``.

:func:`reference` evaluates exactly that in float64 (the tests' reference for every kernel path);
:func:`dot` evaluates it with torch in float32 (the fallback where the C++ kernels cannot be built).
"""

from __future__ import annotations

import torch

from tformer.errors import ConfigError, InputError

Tensor = torch.Tensor
BLOCK = 32
BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}   # bytes per block of 32 values
FORMATS = tuple(BYTES)
GGML_TYPE = {"q8_0": 8, "q4_0": 2, "q4_1": 3}  # ggml_type / GGMLQuantizationType numbers


def check_format(fmt: str) -> None:
    if fmt not in BYTES:
        raise ConfigError(f"unknown block format {fmt!r}; choose one of {', '.join(FORMATS)}.")


def packed_shape(packed: Tensor, fmt: str, what: str) -> tuple[int, int]:
    """``(rows, columns)`` of the float matrix ``packed`` holds: ``(N, G · BYTES[fmt])`` uint8 blocks
    are N rows of ``G · 32`` values.

    Raises:
        ConfigError: ``fmt`` is not a block format.
        InputError: ``packed`` is not such blocks (``what`` names it in the message).
    """
    check_format(fmt)
    if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] % BYTES[fmt]:
        raise InputError(f"{fmt} {what} must be (N, G·{BYTES[fmt]}) uint8 blocks; got "
                         f"{packed.dtype} {tuple(packed.shape)}.")
    return packed.shape[0], packed.shape[1] // BYTES[fmt] * BLOCK


def _round_half_away(v: Tensor) -> Tensor:
    """C's ``roundf`` (half away from zero) exactly: ``floor|v| + floor(2 (|v| - floor|v|))``, signed."""
    a = v.abs()
    f = a.floor()
    return torch.sign(v) * (f + (2 * (a - f)).floor())


def _divide(c: float, d: Tensor) -> Tensor:
    """``c / d`` correctly rounded, 0 where ``d = 0``. (``c / tensor`` in torch is ``reciprocal(d) · c``,
    two roundings: it differs from C's ``c / d`` in the last bit, which moves codes at ties.)"""
    safe = torch.where(d == 0, torch.ones_like(d), d)
    return torch.where(d == 0, torch.zeros_like(d), torch.full_like(d, c) / safe)


def _nibbles(q: Tensor) -> Tensor:
    """``(..., 32)`` integers 0..15 -> ``(..., 16)`` uint8: element i low, element i + 16 high."""
    q = q.to(torch.uint8)
    return q[..., :16] | (q[..., 16:] << 4)


def _fp16_bytes(v: Tensor) -> Tensor:
    """``(..., 1)`` float32 -> ``(..., 2)`` uint8: the little-endian bytes of its fp16 rounding."""
    return v.to(torch.float16).contiguous().view(torch.uint8)


def quantize(weight: Tensor, fmt: str) -> Tensor:
    """Pack a float matrix into ``fmt`` blocks.

    Args:
        weight: ``(N, K)`` float, ``K`` a multiple of 32.
        fmt: ``q8_0``, ``q4_0`` or ``q4_1``.
    Returns:
        ``(N, K/32 · BYTES[fmt])`` uint8: ggml's bytes for the matrix.
    """
    check_format(fmt)
    if weight.dim() != 2 or weight.shape[1] % BLOCK:
        raise InputError(f"block quantisation needs an (N, K) matrix with K a multiple of {BLOCK}; got "
                         f"{tuple(weight.shape)}: keep this layer in float or pad K.")
    N, K = weight.shape
    b = weight.detach().float().reshape(N, K // BLOCK, BLOCK)                      # (N, G, 32)
    if fmt == "q8_0":
        d = b.abs().amax(-1, keepdim=True) / 127
        q = _round_half_away(b * _divide(1.0, d)).to(torch.int8).view(torch.uint8)
        out = torch.cat([_fp16_bytes(d), q], -1)
    elif fmt == "q4_0":
        m = b.gather(-1, b.abs().argmax(-1, keepdim=True))                       # signed value of max |x|
        d = m / -8
        q = torch.trunc(b * _divide(1.0, d) + 8.5).clamp(0, 15)
        out = torch.cat([_fp16_bytes(d), _nibbles(q)], -1)
    else:
        lo, hi = b.amin(-1, keepdim=True), b.amax(-1, keepdim=True)
        d = (hi - lo) / 15
        q = torch.trunc((b - lo) * _divide(1.0, d) + 0.5).clamp(0, 15)
        out = torch.cat([_fp16_bytes(d), _fp16_bytes(lo), _nibbles(q)], -1)
    return out.reshape(N, K // BLOCK * BYTES[fmt]).contiguous()


def _per_block(blocks: Tensor, fmt: str) -> Tensor:
    """``(N, G · size)`` uint8 blocks viewed as ``(N, G, size)``, refused as :func:`packed_shape` refuses."""
    packed_shape(blocks, fmt, "blocks")
    return blocks.reshape(blocks.shape[0], -1, BYTES[fmt])


def unpack(blocks: Tensor, fmt: str) -> tuple[Tensor, Tensor, Tensor | None]:
    """The integer codes and float scales of packed blocks.

    Args:
        blocks: ``(N, G · BYTES[fmt])`` uint8.
    Returns:
        ``(q (N, G, 32) int32, d (N, G) float32, m (N, G) float32 | None)``: q in [-128, 127] for
        q8_0 and in [0, 15] for q4_0 / q4_1 (the ``-8`` of q4_0 is not applied); ``m`` for q4_1 only.
    """
    size, b = BYTES.get(fmt), _per_block(blocks, fmt)                               # (N, G, size)
    d = b[..., 0:2].contiguous().view(torch.float16).float()[..., 0]                # (N, G)
    if fmt == "q8_0":
        return b[..., 2:].contiguous().view(torch.int8).to(torch.int32), d, None
    m = b[..., 2:4].contiguous().view(torch.float16).float()[..., 0] if fmt == "q4_1" else None
    qs = b[..., size - 16:].to(torch.int32)                                          # (N, G, 16)
    return torch.cat([qs & 15, qs >> 4], -1), d, m


def dequantize(blocks: Tensor, fmt: str) -> Tensor:
    """The float32 matrix ``(N, K)`` that packed blocks stand for (equals ``gguf.quants.dequantize``).

    The codes go from bytes to float32 once and are scaled in place (no int32 copies): QLoRA widens every
    tile of the base twice a step (:mod:`tformer.quant.tiled`), so this is its cost."""
    size, b = BYTES.get(fmt), _per_block(blocks, fmt)                               # (N, G, size)
    N = blocks.shape[0]
    d = b[..., 0:2].contiguous().view(torch.float16).float()                         # (N, G, 1)
    if fmt == "q8_0":
        w = b[..., 2:].contiguous().view(torch.int8).float().mul_(d)                 # (N, G, 32)
    else:
        qs = b[..., size - 16:]                                                      # (N, G, 16) nibbles
        w = torch.cat([qs & 15, qs >> 4], -1).float()                                # (N, G, 32)
        if fmt == "q4_0":
            w.sub_(8).mul_(d)
        else:
            w.mul_(d).add_(b[..., 2:4].contiguous().view(torch.float16).float())
    return w.reshape(N, -1)


def quantize_activation(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Rows of activations to 8-bit blocks of 32, as the kernels do before their dot products.

    Args:
        x: ``(M, K)`` float (rounded to float32 first), ``K`` a multiple of 32.
    Returns:
        ``(q (M, G, 32) int32 in [-127, 127], dx (M, G) float32, sums (M, G) int32 = Σ q)`` with
        ``x ≈ dx · q``: ``dx = max|x| / 127`` and ``q = rne(x · (127 / max|x|))`` per block.
    """
    M, K = x.shape
    b = x.float().reshape(M, K // BLOCK, BLOCK)
    a = b.abs().amax(-1)                                                              # (M, G)
    inv = _divide(127.0, a)
    q = torch.round(b * inv[..., None]).to(torch.int32)                               # round half to even
    return q, a / 127, q.sum(-1)


def _terms(blocks: Tensor, fmt: str, x: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """The per-block terms of the module docstring in ``dtype``: ``(M, N, G)`` scale · integer dot,
    and for q4_1 the ``(M, N, G)`` terms ``m · dx · Σ qx`` (else ``None``)."""
    qw, d, m = unpack(blocks, fmt)                                                    # (N, G, 32), (N, G)
    if x.dim() != 2 or x.shape[1] != qw.shape[1] * BLOCK:
        raise InputError(f"the activations are {tuple(x.shape)} but the {fmt} weight has "
                         f"{qw.shape[1] * BLOCK} inputs: pass (M, in_features) rows.")
    qx, dx, sx = quantize_activation(x)                                               # (M, G, 32), (M, G)
    # integer dot per (m, n, block): at most 32 · 128 · 127 in magnitude, exact in float32 and float64
    idot = torch.einsum("ngk,mgk->mng", qw.to(dtype), qx.to(dtype))                  # (M, N, G)
    if fmt == "q4_0":
        idot = idot - 8 * sx.to(dtype)[:, None, :]
    terms = (d.to(dtype)[None] * dx.to(dtype)[:, None]) * idot
    mins = m.to(dtype)[None] * (dx.to(dtype) * sx.to(dtype))[:, None] if fmt == "q4_1" else None
    return terms, mins


def reference(blocks: Tensor, fmt: str, x: Tensor, bias: Tensor | None = None) -> Tensor:
    """``y = W x + b`` by the quantised arithmetic above in float64 (activation rounding included):
    ``x (M, K)`` -> ``(M, N)`` float64. The tests' reference for every kernel path."""
    terms, mins = _terms(blocks, fmt, x, torch.float64)
    y = terms.sum(-1) + (mins.sum(-1) if mins is not None else 0)
    return y + bias.double() if bias is not None else y


def magnitude(blocks: Tensor, fmt: str, x: Tensor) -> Tensor:
    """``Σ_blocks |term|`` per output, float64 ``(M, N)``: what the float32 rounding of the kernels'
    sums is relative to (the tests' tolerance scale)."""
    terms, mins = _terms(blocks, fmt, x, torch.float64)
    return terms.abs().sum(-1) + (mins.abs().sum(-1) if mins is not None else 0)


def dot(blocks: Tensor, fmt: str, x: Tensor, bias: Tensor | None = None) -> Tensor:
    """The same product with torch in float32: ``x (M, K)`` -> ``(M, N)`` float32 (the fallback)."""
    terms, mins = _terms(blocks, fmt, x, torch.float32)
    y = terms.sum(-1) + (mins.sum(-1) if mins is not None else 0)
    return y + bias.float() if bias is not None else y
