"""``nn.Embedding`` over a table in a GGUF block format (Q8_0, Q4_0, Q4_1, or a K-quant), kept as the file stores it.

The table ``(V, D)`` is ggml's bytes ``(V, D/32 · bytes)`` uint8 (:mod:`tformer.quant.blocks`); a
lookup widens only the rows it reads: ids ``(B, T)`` -> bytes ``(B·T, D/32 · bytes)`` ->
:func:`tformer.quant.blocks.dequantize` (or kblocks') -> ``(B, T, D)`` float32, the values ``gguf.quants.dequantize``
gives for those rows (ggml's ``get_rows`` does the same). A tied LM head is a
:class:`~tformer.quant.block_linear.BlockLinear` over the same buffer, so the file's matrix is held once.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tformer.quant import kblocks

Tensor = torch.Tensor


class BlockEmbedding(nn.Module):
    """A drop-in for ``nn.Embedding`` (inference only) over block-quantised rows.

    Args:
        packed: ``(num_embeddings, embedding_dim/32 · BYTES[fmt])`` uint8 blocks.
        fmt: ``q8_0``, ``q4_0``, ``q4_1``, ``q4_k``, ``q5_k`` or ``q6_k``.
    """

    inference_only = True  # blocks, not a float table: tformer.checkpoint refuses to save it

    def __init__(self, packed: Tensor, fmt: str):
        super().__init__()
        self.num_embeddings, self.embedding_dim = kblocks.maths(fmt).packed_shape(packed, fmt, "embedding rows")
        self.fmt = fmt
        self.register_buffer("blocks", packed.contiguous())
        # what callers read off an embedding's ``weight`` (its dtype and device, e.g. for a KV cache)
        self.register_buffer("probe", torch.empty(0, dtype=torch.float32, device=packed.device), persistent=False)

    @property
    def weight(self) -> Tensor:
        """An empty float32 tensor on the table's device: the dtype and device an ``nn.Embedding``'s weight
        would tell (the rows themselves exist only as blocks)."""
        return self.probe

    def forward(self, ids: Tensor) -> Tensor:
        rows = self.blocks.index_select(0, ids.reshape(-1))                           # (B·T, G·bytes)
        return kblocks.maths(self.fmt).dequantize(rows, self.fmt).view(*ids.shape, self.embedding_dim)  # (B, T, D)

    def dequantized(self) -> Tensor:
        """The float32 table ``(V, D)`` (for checks; lookups never build it)."""
        return kblocks.maths(self.fmt).dequantize(self.blocks, self.fmt)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.fmt} blocks"
