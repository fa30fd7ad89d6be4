"""GGUF's K-quant formats Q4_K, Q5_K and Q6_K (and the 5-bit Q5_0 / Q5_1), byte for byte as ggml stores
them, and the arithmetic of a product with activations quantised to ggml's Q8_K, as llama.cpp multiplies
them: the formats tformer multiplies in the file layout, one weight row at a time (kquants.h).

A weight row of ``K`` values (``K`` a multiple of 256) is ``K / 256`` super-blocks, each a little-endian
struct (ggml's ``block_q4_K`` / ``block_q5_K`` / ``block_q6_K``):

==========  =====  ===========================================================  ==============================
format      bytes  layout                                                       value of element ``e``
==========  =====  ===========================================================  ==============================
``q4_k``    144    ``d``, ``dmin`` fp16, ``scales[12]``, ``qs[128]`` nibbles      ``(d·sc_j)·q_e - (dmin·m_j)``
``q5_k``    176    ``d``, ``dmin`` fp16, ``scales[12]``, ``qh[32]``, ``qs[128]``  the same, ``q_e`` of 5 bits
``q6_k``    210    ``ql[128]``, ``qh[64]``, ``scales[16]`` int8, ``d`` fp16       ``(d·sc_g)·(q_e - 32)``
==========  =====  ===========================================================  ==============================

- q4_k / q5_k: eight sub-blocks ``j`` of 32 with a 6-bit scale ``sc_j`` and a 6-bit min ``m_j``, packed in
  12 bytes (bytes 0-3: low 6 bits of sc 0-3, bytes 4-7: of m 0-3, bytes 8-11: sc 4-7 in the low nibble and
  m 4-7 in the high one, their top 2 bits in the top bits of bytes 0-3 / 4-7). ``qs`` holds 64 values per
  32 bytes: byte ``l`` of chunk ``c`` is element ``64c + l`` (low nibble) and ``64c + 32 + l`` (high);
  q5_k's fifth bit of element ``32 j + l`` is bit ``j`` of ``qh[l]``.
- q6_k: sixteen groups ``g`` of 16 with an int8 scale; per half ``h`` of 128 values, ``ql[64h + l]``
  holds elements ``l`` (low nibble) and ``64 + l`` (high), ``ql[64h + 32 + l]`` elements ``32 + l`` and
  ``96 + l``, and ``qh[32h + l]`` their top two bits at bits 0, 2, 4, 6 (elements ``l, 32+l, 64+l, 96+l``).

:func:`dequantize` equals ``gguf.quants.dequantize`` exactly (the same float32 steps: ``d·sc`` first).

Activations (:func:`quantize_activation`, ggml's ``quantize_row_q8_K_ref``): per block of 256, ``max`` is
the value of largest magnitude (the first on ties), ``iscale = -127 / max``, ``q = min(127, rne(iscale·x))``
(round half to even), ``dx = 1 / iscale`` (float32, so ``x ≈ dx·q``), and ``bsums`` the sums of each 16
codes. One super-block's contribution to ``y = W x`` is then integers times two floats:

- q4_k / q5_k: ``(d·dx)·Σ_j sc_j Σ_{e∈j} q_e qx_e - (dmin·dx)·Σ_j m_j (bsum_{2j} + bsum_{2j+1})``;
- q6_k: ``(d·dx)·Σ_g sc_g (Σ_{e∈g} q_e qx_e - 32 bsum_g)``.

Every sum over a super-block is an exact integer (|Σ| < 2^31); only the per-super-block floats round.

Q5_0 (22 bytes: ``d`` fp16, ``qh`` 4 bytes, ``qs[16]``) and Q5_1 (24: ``d``, ``m`` fp16, ``qh``, ``qs``) are
blocks of 32 whose code ``q_e`` is the nibble of :mod:`tformer.quant.blocks`'s layout plus bit ``e`` of the
little-endian ``qh`` as its fifth bit; values ``d·(q_e - 16)`` and ``d·q_e + m``. llama.cpp's fallbacks where
a row is no multiple of 256 (Q4_K -> Q5_0, Q5_K -> Q5_1): Qwen2.5-0.5B's 896-wide matrices in a Q4_K_M file.
Their activations are tformer's 8-bit blocks of 32 (:func:`tformer.quant.blocks.quantize_activation`), and a
block contributes ``d·dx·(Σ q qx - 16 Σ qx)`` or ``d·dx·Σ q qx + m·dx·Σ qx``.
:func:`reference` evaluates that in float64 (the tests' reference for every kernel path, activation
rounding included); :func:`dot` in float32 with torch (the fallback where the kernels cannot be built).
"""

from __future__ import annotations

import sys

import torch

from tformer.errors import ConfigError, InputError

Tensor = torch.Tensor
SUPER = 256                                            # values per super-block
BYTES = {"q4_k": 144, "q5_k": 176, "q6_k": 210, "q5_0": 22, "q5_1": 24}   # bytes per (super-)block
VALUES = {"q4_k": SUPER, "q5_k": SUPER, "q6_k": SUPER, "q5_0": 32, "q5_1": 32}   # values per (super-)block
FORMATS = tuple(BYTES)
KQUANTS = ("q4_k", "q5_k", "q6_k")
GGML_TYPE = {"q4_k": 12, "q5_k": 13, "q6_k": 14, "q5_0": 6, "q5_1": 7}   # ggml_type / GGMLQuantizationType numbers


def check_format(fmt: str) -> None:
    if fmt not in BYTES:
        raise ConfigError(f"unknown K-quant format {fmt!r}; choose one of {', '.join(FORMATS)}.")


def packed_shape(packed: Tensor, fmt: str, what: str) -> tuple[int, int]:
    """``(rows, columns)`` of the float matrix that ``(N, S · BYTES[fmt])`` uint8 (super-)blocks stand for."""
    check_format(fmt)
    if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] % BYTES[fmt]:
        raise InputError(f"{fmt} {what} must be (N, S·{BYTES[fmt]}) uint8 blocks; got "
                         f"{packed.dtype} {tuple(packed.shape)}.")
    return packed.shape[0], packed.shape[1] // BYTES[fmt] * VALUES[fmt]


def _fp16(b: Tensor) -> Tensor:
    """``(..., 2)`` uint8 -> ``(...)`` float32: little-endian fp16."""
    return b.contiguous().view(torch.float16).float()[..., 0]


def _scale_min(s: Tensor) -> tuple[Tensor, Tensor]:
    """``(..., 12)`` packed 6-bit scales -> ``(sc, m)``, each ``(..., 8)`` int32 (ggml's get_scale_min_k4)."""
    s = s.to(torch.int32)
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([lo & 63, (hi & 15) | ((lo >> 6) << 4)], -1)
    m = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], -1)
    return sc, m


def unpack(packed: Tensor, fmt: str) -> dict[str, Tensor]:
    """The integer codes, scales and float factors of ``(N, S · BYTES[fmt])`` super-blocks.

    Returns a dict: ``q (N, S, 256)`` int32 codes (q4_k 0..15, q5_k 0..31, q6_k -32..31, the offset
    applied), ``sc (N, S, 8 | 16)`` int32 sub-block scales, ``d (N, S)`` float32, and for q4_k / q5_k
    ``m (N, S, 8)`` int32 mins and ``dmin (N, S)`` float32.
    """
    rows, _ = packed_shape(packed, fmt, "blocks")
    b = packed.reshape(rows, -1, BYTES[fmt])                                       # (N, S, bytes)
    N, S = b.shape[:2]
    if fmt in ("q5_0", "q5_1"):
        at = 4 if fmt == "q5_1" else 2
        qh = b[..., at:at + 4].contiguous().view(torch.int32)                       # (N, S, 1) little-endian bits
        qs = b[..., at + 4:].to(torch.int32)
        q = torch.cat([qs & 15, qs >> 4], -1) | (((qh >> torch.arange(32, dtype=torch.int32)) & 1) << 4)
        out = {"q": q, "d": _fp16(b[..., 0:2])}
        if fmt == "q5_1":
            out["m"] = _fp16(b[..., 2:4])
        return out
    if fmt == "q6_k":
        ql, qh = b[..., :128].to(torch.int32), b[..., 128:192].to(torch.int32)
        sc = b[..., 192:208].contiguous().view(torch.int8).to(torch.int32)
        ql = ql.reshape(N, S, 2, 2, 32)                                            # (half, lo/hi 32 bytes, l)
        low = torch.stack([ql & 15, ql >> 4], 3)                                   # (N,S,half, nib, part, l)
        qh = qh.reshape(N, S, 2, 1, 32)
        top = torch.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], 3)                # (N,S,half, 4, 1, l)
        # element 32k + l of a half: k = 0 ql[l] low, 1 ql[32+l] low, 2 ql[l] high, 3 ql[32+l] high
        low = low.reshape(N, S, 2, 4, 32)
        q = (low | (top.reshape(N, S, 2, 4, 32) << 4)) - 32
        return {"q": q.reshape(N, S, SUPER), "sc": sc, "d": _fp16(b[..., 208:210])}
    sc, m = _scale_min(b[..., 4:16])
    qs = b[..., BYTES[fmt] - 128:].to(torch.int32).reshape(N, S, 4, 1, 32)
    q = torch.cat([qs & 15, qs >> 4], 3).reshape(N, S, SUPER)                       # chunk c: low, then high
    if fmt == "q5_k":
        qh = b[..., 16:48].to(torch.int32).reshape(N, S, 1, 32)
        q = q | (((qh >> torch.arange(8, dtype=torch.int32)[:, None]) & 1) << 4).reshape(N, S, SUPER)
    return {"q": q, "sc": sc, "m": m, "d": _fp16(b[..., 0:2]), "dmin": _fp16(b[..., 2:4])}


def dequantize(packed: Tensor, fmt: str) -> Tensor:
    """The float32 matrix ``(N, K)`` the super-blocks stand for (equals ``gguf.quants.dequantize``)."""
    u = unpack(packed, fmt)
    N, S = u["d"].shape
    if fmt == "q5_0":
        return (u["d"][..., None] * (u["q"] - 16).float()).reshape(N, -1)
    if fmt == "q5_1":
        return (u["d"][..., None] * u["q"].float() + u["m"][..., None]).reshape(N, -1)
    per = SUPER // u["sc"].shape[-1]                                               # 32 or 16 values a scale
    q = u["q"].float().reshape(N, S, -1, per)
    w = (u["d"][..., None] * u["sc"].float())[..., None] * q
    if fmt != "q6_k":
        w = w - (u["dmin"][..., None] * u["m"].float())[..., None]
    return w.reshape(N, S * SUPER)


def quantize_activation(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Rows of activations to ggml's Q8_K blocks of 256.

    Args:
        x: ``(M, K)`` float (rounded to float32 first), ``K`` a multiple of 256.
    Returns:
        ``(q (M, S, 256) int32 in [-127, 127], dx (M, S) float32, bsums (M, S, 16) int32)``.
    """
    M, K = x.shape
    b = x.float().reshape(M, K // SUPER, SUPER)
    big = b.gather(-1, b.abs().argmax(-1, keepdim=True))[..., 0]                   # (M, S) signed value of max |x|
    safe = torch.where(big == 0, torch.ones_like(big), big)
    iscale = torch.where(big == 0, torch.zeros_like(big), torch.full_like(big, -127.0) / safe)
    q = torch.round(b * iscale[..., None]).clamp(max=127).to(torch.int32)          # round half to even
    dx = torch.where(big == 0, torch.zeros_like(big), 1.0 / torch.where(big == 0, torch.ones_like(iscale), iscale))
    return q, dx, q.reshape(M, -1, 16, 16).sum(-1)


def _terms(packed: Tensor, fmt: str, x: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Per (row m, output n, super-block): the scale term and the min term (subtracted), ``(M, N, S)``."""
    u = unpack(packed, fmt)
    N, S = u["d"].shape
    if x.dim() != 2 or x.shape[1] != S * VALUES[fmt]:
        raise InputError(f"the activations are {tuple(x.shape)} but the {fmt} weight has {S * VALUES[fmt]} "
                         f"inputs: pass (M, in_features) rows.")
    if fmt in ("q5_0", "q5_1"):
        return _q5_terms(u, fmt, x, dtype)
    qx, dx, bsums = quantize_activation(x)
    G = u["sc"].shape[-1]
    # integer dot per (m, n, super-block, sub-block): |.| <= 32 · 63 · 127, exact in float32/64
    part = torch.einsum("nsgk,msgk->mnsg", u["q"].reshape(N, S, G, -1).to(dtype), qx.reshape(-1, S, G, SUPER // G).to(dtype))
    scale = (u["d"].to(dtype)[None] * dx.to(dtype)[:, None])                        # (M, N, S)
    isum = (part * u["sc"].to(dtype)[None]).sum(-1)                                 # exact integers
    if fmt == "q6_k":
        return scale * isum, torch.zeros_like(isum)
    pair = bsums.reshape(-1, S, 8, 2).sum(-1).to(dtype)                              # (M, S, 8)
    mins = torch.einsum("nsj,msj->mns", u["m"].to(dtype), pair)
    return scale * isum, (u["dmin"].to(dtype)[None] * dx.to(dtype)[:, None]) * mins


def _q5_terms(u: dict, fmt: str, x: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Q5_0 / Q5_1's per-block terms ``(M, N, G)``: the scale term, and minus the q5_1 min term."""
    from tformer.quant import blocks

    qx, dx, sx = blocks.quantize_activation(x)                                     # (M, G, 32), (M, G)
    idot = torch.einsum("ngk,mgk->mng", u["q"].to(dtype), qx.to(dtype))
    if fmt == "q5_0":
        idot = idot - 16 * sx.to(dtype)[:, None, :]
    terms = (u["d"].to(dtype)[None] * dx.to(dtype)[:, None]) * idot
    if fmt == "q5_0":
        return terms, torch.zeros_like(terms)
    return terms, -(u["m"].to(dtype)[None] * (dx.to(dtype) * sx.to(dtype))[:, None])


def reference(packed: Tensor, fmt: str, x: Tensor, bias: Tensor | None = None) -> Tensor:
    """``y = W x + b`` by the arithmetic above in float64 (Q8_K rounding included): ``(M, N)`` float64."""
    t, m = _terms(packed, fmt, x, torch.float64)
    y = (t - m).sum(-1)
    return y + bias.double() if bias is not None else y


def magnitude(packed: Tensor, fmt: str, x: Tensor) -> Tensor:
    """``Σ |term|`` per output, float64 ``(M, N)``: what the kernels' float32 rounding is relative to."""
    t, m = _terms(packed, fmt, x, torch.float64)
    return (t.abs() + m.abs()).sum(-1)


def dot(packed: Tensor, fmt: str, x: Tensor, bias: Tensor | None = None) -> Tensor:
    """The same product in float32 with torch: ``(M, N)`` float32 (the fallback)."""
    t, m = _terms(packed, fmt, x, torch.float32)
    y = (t - m).sum(-1)
    return y + bias.float() if bias is not None else y


def random_blocks(rows: int, cols: int, fmt: str, generator: torch.Generator, scale: float = 1e-3) -> Tensor:
    """Random ``(rows, cols/256 · BYTES)`` super-blocks with finite fp16 factors of about ``scale``: every
    code and packed scale byte drawn at random (tests and benchmarks of the kernels)."""
    check_format(fmt)
    S = cols // VALUES[fmt]
    b = torch.randint(0, 256, (rows, S, BYTES[fmt]), dtype=torch.uint8, generator=generator)
    factor = (torch.rand(rows, S, 2, generator=generator) * scale + scale / 4).half().view(torch.uint8)  # (rows,S,4)
    if fmt == "q5_0":
        b[..., 0:2] = factor[..., :2]
    elif fmt == "q6_k":
        b[..., 208:210] = factor[..., :2]
    else:
        b[..., 0:4] = factor
    return b.reshape(rows, S * BYTES[fmt])


def maths(fmt: str):
    """The module that holds ``fmt``'s layout (packed_shape, dequantize): this one for the formats read in
    the file layout, :mod:`tformer.quant.blocks` for the tiled blocks of 32."""
    from tformer.quant import blocks

    return sys.modules[__name__] if fmt in BYTES else blocks


def row_bytes(fmt: str, k: int) -> int:
    """Bytes of one stored row of ``k`` values in ``fmt`` (any GGUF block format tformer keeps)."""
    return k // VALUES.get(fmt, 32) * maths(fmt).BYTES[fmt]
