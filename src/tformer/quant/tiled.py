"""A block-quantised weight's product in float, tile by tile, differentiable with respect to its input:
what training over a GGUF file's blocks (QLoRA) runs, the base never widened as a whole.

    forward   y[:, r:r+t] = x · W_tᵀ (+ b[r:r+t])     W_t = dequantize(blocks[r:r+t])  (t, K) float32
    backward  ∂L/∂x = Σ_t ∂L/∂y[:, r:r+t] · W_t        the same tiles, dequantised again

``W_t`` is exactly the float matrix the blocks stand for (:func:`tformer.quant.blocks.dequantize`, equal to
``gguf.quants.dequantize``), so the product is ``F.linear`` over the dequantised weight, summed in the same
order along ``K``: the same outputs and input gradients as a float copy of the base, while at most one
tile of ``TILE_ROWS`` rows is held in float at a time. The weight gets no gradient (it is the frozen base).
Unlike :class:`~tformer.quant.block_linear.BlockLinear`'s integer products (inference), the activations are
not rounded to 8 bits. Any format whose rows :func:`~tformer.quant.blocks.dequantize` widens works.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tformer.quant import kblocks

Tensor = torch.Tensor
TILE_ROWS = 1024      # rows widened at a time: 1024 x 2048 floats = 8 MB at a 1B model's width


def tiles(packed: Tensor, fmt: str, dtype: torch.dtype, tile_rows: int = TILE_ROWS):
    """``(row, W_t)`` for each tile of ``tile_rows`` rows: the float weights, in ``dtype``."""
    for r in range(0, packed.shape[0], tile_rows):
        yield r, kblocks.maths(fmt).dequantize(packed[r:r + tile_rows], fmt).to(dtype)


class _TiledProduct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2: Tensor, packed: Tensor, fmt: str, bias: Tensor | None, tile_rows: int) -> Tensor:
        ctx.packed, ctx.fmt, ctx.tile_rows = packed, fmt, tile_rows
        out = x2.new_empty(x2.shape[0], packed.shape[0])                                     # (M, N)
        for r, w in tiles(packed, fmt, x2.dtype, tile_rows):
            b = bias[r:r + w.shape[0]].to(x2.dtype) if bias is not None else None
            out[:, r:r + w.shape[0]] = F.linear(x2, w, b)                                    # (M, t)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        gx = None
        if ctx.needs_input_grad[0]:
            for r, w in tiles(ctx.packed, ctx.fmt, grad.dtype, ctx.tile_rows):
                part = grad[:, r:r + w.shape[0]] @ w                                         # (M, K)
                gx = part if gx is None else gx.add_(part)
        return gx, None, None, None, None


def tiled_linear(x: Tensor, packed: Tensor, fmt: str, bias: Tensor | None = None,
                 tile_rows: int = TILE_ROWS) -> Tensor:
    """``x (..., K) @ Wᵀ + b`` -> ``(..., N)`` with ``W`` the float matrix of ``packed`` ``(N, ·)`` blocks in
    ``fmt``, tile by tile (module docstring); differentiable with respect to ``x``."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        x2 = x2.float()
    if torch.is_autocast_enabled(x.device.type):                 # the autocast dtype, as F.linear would run
        x2 = x2.to(torch.get_autocast_dtype(x.device.type))
    y = _TiledProduct.apply(x2, packed, fmt, bias, tile_rows)
    return y.view(*x.shape[:-1], packed.shape[0])
