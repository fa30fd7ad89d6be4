"""Attention: the functional entry point, masks, and the multi-head module."""

from tformer.ops.sdpa import choose_backend, scaled_dot_product_attention
from tformer.ops.flash import flash_attention
from tformer.ops.masks import causal_mask, padding_mask, sliding_window_mask

__all__ = [
    "causal_mask", "choose_backend", "flash_attention", "padding_mask", "scaled_dot_product_attention",
    "sliding_window_mask",
]
