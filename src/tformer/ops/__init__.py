"""Kernels, no parameters: the attention entry point and its backends, masks, the efficient-attention
kernels, the selective scan and the C++ training kernels. Re-exported here: the attention entry point
(``scaled_dot_product_attention``, ``choose_backend``, ``flash_attention``) and the masks. The
multi-head module that calls them is :class:`tformer.mixers.attention.MultiHeadAttention`."""

from tformer.ops.sdpa import choose_backend, scaled_dot_product_attention
from tformer.ops.flash import flash_attention
from tformer.ops.masks import causal_mask, padding_mask, sliding_window_mask

__all__ = [
    "causal_mask", "choose_backend", "flash_attention", "padding_mask", "scaled_dot_product_attention",
    "sliding_window_mask",
]
