"""``nn.Linear`` with its weight in a GGUF block format (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), used as stored.

The weight ``(N, K)`` is held as ggml's bytes, ``(N, K/32 · bytes)`` uint8 (:mod:`tformer.quant.blocks`),
and never widened into a float copy: every call quantises its input rows to 8-bit blocks and runs
the integer block products of :mod:`tformer.quant.qgemv` (AVX2, AVX-512 VNNI or portable C++,
picked from the CPU), so a decode step reads 34 / 18 / 20 bytes per 32 weights (8.5 / 4.5 / 5
bits a weight against bfloat16's 16). The K-quants (:mod:`tformer.quant.kblocks`: 4.5 / 5.5 / 6.56 bits a
weight) and Q5_0 / Q5_1 run :func:`tformer.quant.qgemv.kqgemm` on the file layout, the K-quants'
activations rounded to Q8_K (blocks of 256) as llama.cpp rounds them. The bias stays float32.

Error against the float layer: each weight is off by at most half its block's step (q8_0:
``max|W_b| / 254``; q4_0: ``max|W_b| / 16``; q4_1: ``(max - min) / 30``) plus fp16's rounding of the
scales, and each activation by at most half its block's step ``max|x_b| / 254``.
"""

from __future__ import annotations

import threading
import weakref

import torch
import torch.nn as nn

from tformer.errors import InputError
from tformer.quant import blocks, kblocks, pages, qgemv
from tformer.quant.tiled import tiled_linear

Tensor = torch.Tensor
# layer -> the lock held while it makes its tiles: the whole-layer plan makes them on a thread of its own
# (tformer.fused.pending) while a first call may ask for them; one lock a layer, so two threads make two at once
_MAKING: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_MAKING_GUARD = threading.Lock()


def _making(layer) -> threading.Lock:
    with _MAKING_GUARD:
        lock = _MAKING.get(layer)
        if lock is None:
            lock = _MAKING[layer] = threading.Lock()
        return lock


class BlockLinear(nn.Module):
    """A drop-in for ``nn.Linear`` (inference only) over block-quantised weights.

    Args:
        packed: ``(out_features, in_features/32 · BYTES[fmt])`` uint8 blocks (a GGUF tensor's bytes).
        fmt: ``q8_0``, ``q4_0``, ``q4_1`` (tiled blocks of 32) or ``q5_0``, ``q5_1``, ``q4_k``, ``q5_k``, ``q6_k``
            (read in the file layout).
        bias: ``(out_features,)`` float or None.
    """

    inference_only = True  # blocks, not nn.Linear's weight: tformer.checkpoint refuses to save it
    float_tiles = False    # True (use_float_tiles): float products tile by tile, for training (quant/tiled.py)

    def __init__(self, packed: Tensor, fmt: str, bias: Tensor | None = None):
        super().__init__()
        self.kquant = fmt in kblocks.BYTES               # multiplied by kqgemm (kblocks' maths)
        self.tiled = fmt in qgemv.TILED                  # read as tiles on a SIMD path (else the file layout)
        self.out_features, self.in_features = kblocks.maths(fmt).packed_shape(packed, fmt, "weights")
        self.fmt = fmt
        if bias is not None and bias.shape != (self.out_features,):
            raise InputError(f"the bias is {tuple(bias.shape)} but the weight has {self.out_features} outputs.")
        self.register_buffer("blocks", packed.contiguous())
        self.register_buffer("bias", bias.detach().float().contiguous() if bias is not None else None)
        self._tiled: dict[str, Tensor | None] = {}        # kernel path -> qgemv.tiles(blocks) (not state)

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: str) -> "BlockLinear":
        """Quantise a float layer (``in_features`` a multiple of 32) with ggml's rounding."""
        return cls(blocks.quantize(linear.weight, fmt), fmt, linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        if self.float_tiles:
            return tiled_linear(x, self.blocks, self.fmt, self.bias)
        x2 = x.reshape(-1, self.in_features)                                           # (M, K)
        if x2.requires_grad and torch.is_grad_enabled():     # a gradient w.r.t. the input is asked (attribution)
            y = _InputGradient.apply(x2, self)
        else:
            y = self.product(x2)
        return y.view(*x.shape[:-1], self.out_features)

    def product(self, x2: Tensor) -> Tensor:
        """``x2 (M, K) @ Wᵀ + b`` by the integer block products: ``(M, N)`` in ``x2``'s dtype."""
        p = qgemv.path()
        tiled = self.tiles(p)
        if tiled is not None:                                      # a SIMD path's tiles: the file layout is not read
            return qgemv.tile_product(tiled, self.fmt, self.out_features, x2, self.bias, p)        # (M, N) in x's dtype
        product = qgemv.kqgemm if self.kquant else qgemv.qgemm     # kblocks' formats or blocks'
        return product(self.file_layout(), self.fmt, x2, self.bias, p)                  # (M, N) in x's dtype

    def file_layout(self) -> Tensor:
        """What a kernel that reads the file layout (the K-quants, the scalar path) reads: ``blocks``."""
        return self.blocks

    def tiles(self, kernel_path: str | None) -> Tensor | None:
        """The SIMD path's interleaved rows (:func:`tformer.quant.qgemv.tiles`; ``None``: a path that reads
        the file layout), made at the first call on a path and kept. The file layout stays in ``blocks``
        (what the checks, dequantisation and export read); where it is a mapped file's pages, they are
        handed back once copied (:mod:`tformer.quant.pages`), so the weights are held once."""
        if not self.tiled or kernel_path not in qgemv.TILE_ROWS:
            return None
        tiled = self._tiled.get(kernel_path)
        if tiled is None:
            with _making(self):  # one maker a layer: a plan's background thread and a first call may race
                tiled = self._tiled.get(kernel_path)
                if tiled is None:
                    tiled = self._tiled[kernel_path] = self._make_tiles(kernel_path)
        return tiled

    def _make_tiles(self, kernel_path: str) -> Tensor | None:
        return qgemv.tiles(self.blocks, self.fmt, kernel_path, release=pages.mapped(self.blocks))

    def dequantized(self) -> Tensor:
        """The float32 weight ``(N, K)`` the blocks stand for (for checks; the layer never builds it)."""
        return kblocks.maths(self.fmt).dequantize(self.blocks, self.fmt)

    def decode_tensors(self) -> list[Tensor]:
        """What one call reads: for :func:`tformer.quant.quantize.weight_bytes`."""
        return [t for t in (self.blocks, self.bias) if t is not None]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.fmt} blocks"


_JOINING = threading.local()       # per thread: the buffer JoinedLinear joins its rows in to make their tiles


class JoinedLinear(BlockLinear):
    """A :class:`BlockLinear` whose rows are held as several tensors in one format, joined only where a
    kernel reads the file layout: a GGUF's q, k and v (one ``qkv_proj``), each a view of the mapped file.
    On a SIMD path the tiles are made from the rows and the file's pages handed back, so the weights are
    held once (as tiles), not also as a joined copy; a path that reads the file layout (the K-quants, the
    scalar path) joins them once and keeps that (the file's pages handed back). Checks, export and LoRA
    read :attr:`blocks`, joined for them (a copy per read) where no joined copy is kept.

    Args:
        rows: ``(n_i, in_features/32 · BYTES[fmt])`` uint8 tensors, in output order.
        fmt, bias: as :class:`BlockLinear`'s (``bias`` over all ``sum n_i`` outputs).
    """

    def __init__(self, rows: list[Tensor], fmt: str, bias: Tensor | None = None):
        nn.Module.__init__(self)
        self.rows = [r.contiguous() for r in rows]
        self._joined: Tensor | None = None                # the file layout, where a kernel reads it
        shapes = [kblocks.maths(fmt).packed_shape(r, fmt, "weights") for r in self.rows]
        if len({k for _, k in shapes}) != 1:
            raise InputError(f"joined rows must share their width; got {[k for _, k in shapes]}.")
        self.kquant, self.tiled, self.fmt = fmt in kblocks.BYTES, fmt in qgemv.TILED, fmt
        self.out_features, self.in_features = sum(n for n, _ in shapes), shapes[0][1]
        if bias is not None and bias.shape != (self.out_features,):
            raise InputError(f"the bias is {tuple(bias.shape)} but the weight has {self.out_features} outputs.")
        self.register_buffer("bias", bias.detach().float().contiguous() if bias is not None else None)
        self._tiled: dict[str, Tensor | None] = {}

    @property
    def blocks(self) -> Tensor:
        """``(N, row bytes)`` uint8, the rows joined: the copy a kernel reads where one is kept, else a new one."""
        return self._joined if self._joined is not None else torch.cat(self.rows)

    def file_layout(self) -> Tensor:
        """The rows joined once and kept (a kernel reads them every call); the file's pages handed back."""
        if self._joined is None:
            with _making(self):                                 # the plan's gathering and a first call may race
                if self._joined is None:
                    self._joined = torch.cat(self.rows)
                    for r in self.rows:
                        pages.release(r)
        return self._joined

    def _make_tiles(self, kernel_path: str) -> Tensor | None:
        """Tiles made from the rows joined into this thread's buffer (reused layer after layer: a model's opening
        touches its pages once), then the file's pages handed back."""
        n, width = self.out_features, self.rows[0].shape[1]
        held = getattr(_JOINING, "buffer", None)
        if held is None or held.numel() < n * width:
            held = _JOINING.buffer = torch.empty(n * width, dtype=torch.uint8)
        joined = torch.cat(self.rows, out=held[:n * width].view(n, width))             # (N, row bytes)
        tiled = qgemv.tiles(joined, self.fmt, kernel_path)
        if tiled is not None:
            for r in self.rows:
                pages.release(r)
        return tiled

    def decode_tensors(self) -> list[Tensor]:
        return [t for t in (*self.rows, self.bias) if t is not None]


class StackedLinear(nn.Module):
    """Several block layers over the same input whose outputs are joined: ``y = [l_1(x) | l_2(x) | ...]``.
    A GGUF's q, k and v stored in different formats (a Q4_K_M layer with a Q6_K ``attn_v``) make one
    ``qkv_proj`` this way, each part multiplied in its own format (inference only).

    Args:
        parts: the layers, in output order, all with the same ``in_features``.
    """

    inference_only = True

    def __init__(self, parts: list[BlockLinear]):
        super().__init__()
        if len({p.in_features for p in parts}) != 1:
            raise InputError(f"stacked layers must share their input width; got {[p.in_features for p in parts]}.")
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([p(x) for p in self.parts], -1)                               # (..., sum N_i)

    def dequantized(self) -> Tensor:
        """The float32 weight ``(N, K)`` the parts stand for, rows in order (for checks)."""
        return torch.cat([p.dequantized() for p in self.parts])

    def decode_tensors(self) -> list[Tensor]:
        return [t for p in self.parts for t in p.decode_tensors()]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " + \
            " | ".join(f"{p.out_features} {p.fmt}" for p in self.parts)


class _InputGradient(torch.autograd.Function):
    """The block product, differentiable with respect to its input (the weights stay fixed blocks): forward
    ``y = x Wᵀ + b`` as the layer computes it; backward ``∂L/∂x = ∂L/∂y · W`` with ``W`` the float weight the
    blocks stand for, widened for that one product (the 8-bit rounding of ``x`` is taken as the identity,
    straight through). What the playground's input × gradient attribution needs on a block model."""

    @staticmethod
    def forward(ctx, x2: Tensor, layer: "BlockLinear") -> Tensor:
        ctx.layer = layer
        return layer.product(x2.detach())

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad @ ctx.layer.dequantized().to(grad.dtype), None                   # (M, N) @ (N, K)


def quantize_blocks(model: nn.Module, fmt: str) -> nn.Module:
    """Replace every ``nn.Linear`` whose ``in_features`` is a multiple of 32 by a :class:`BlockLinear`
    in ``fmt``, in place (others, such as Mamba's ``dt_proj``, stay in float); returns the model.
    A tied LM head becomes its own quantised copy; the embedding keeps its float table."""
    blocks.check_format(fmt)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child.in_features % blocks.BLOCK == 0:
                setattr(module, name, BlockLinear.from_linear(child, fmt))
    return model


def use_float_tiles(model: nn.Module) -> int:
    """Make every :class:`BlockLinear` of ``model`` compute in float tile by tile (:mod:`tformer.quant.tiled`:
    exact float products over the dequantised blocks, differentiable w.r.t. the input), for training over the
    blocks; the number of layers switched."""
    layers = [m for m in model.modules() if isinstance(m, BlockLinear)]
    for m in layers:
        m.float_tiles = True
    return len(layers)
