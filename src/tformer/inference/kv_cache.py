"""The KV cache: keys and values of earlier tokens, kept so each new token costs O(n), not O(n²).

Without a cache, generating token ``t`` recomputes the keys and values of all ``t - 1`` earlier
tokens in every layer. They never change (a causal model's past does not depend on its future),
so we store them once. Each layer gets two buffers of shape ``(B, n_kv_heads, max_len, head_dim)``,
allocated before generation starts and written in place: no per-token allocation, no
concatenation. Only the ``n_kv_heads`` key/value heads are stored, so grouped-query attention
shrinks the cache by ``n_heads / n_kv_heads`` (Ainslie et al., 2023).

Size: ``2 · n_layers · max_len · n_kv_heads · head_dim · bytes_per_element`` per sequence
(:func:`tformer.accounting.kv_cache_bytes`).
"""

from __future__ import annotations

import torch
import torch.nn as nn

Tensor = torch.Tensor


class KVCache(nn.Module):
    """One layer's cache.

    Args:
        batch_size: sequences decoded together.
        n_kv_heads: key/value heads of the layer.
        max_len: the most positions the cache can hold (prompt + new tokens).
        head_dim: width of one head.
        dtype: element type; the model's activation dtype.
        device: where the buffers live.
    """

    def __init__(self, batch_size: int, n_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        super().__init__()
        shape = (batch_size, n_kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.max_len = max_len

    def update(self, start_pos: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write ``k, v (B, nkv, T, hs)`` at positions ``start_pos .. start_pos + T - 1``.

        Returns:
            ``(k_all, v_all)``: views ``(B, nkv, start_pos + T, hs)`` of everything held so far.
        Raises:
            ValueError: if the write would run past ``max_len`` or the batch size differs.
        """
        end = start_pos + k.shape[-2]
        if end > self.max_len or k.shape[0] != self.k.shape[0]:
            raise ValueError(
                f"KV cache holds batch {self.k.shape[0]} x {self.max_len} positions; cannot write batch "
                f"{k.shape[0]} at positions {start_pos}..{end - 1}. Set up the cache with a larger max_len."
            )
        self.k[:, :, start_pos:end] = k
        self.v[:, :, start_pos:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]

    @property
    def nbytes(self) -> int:
        """Bytes held by this layer's two buffers."""
        return self.k.nbytes + self.v.nbytes


def setup_kv_cache(model: nn.Module, batch_size: int, max_len: int,
                   dtype: torch.dtype | None = None) -> list[KVCache]:
    """Attach a fresh :class:`KVCache` to the self-attention of every block of ``model``.

    Args:
        model: a :class:`~tformer.models.decoder.DecoderLM` (anything with ``blocks[i].attn``).
        batch_size: sequences decoded together.
        max_len: prompt length + new tokens; at most ``config.context_length`` for learned or
            sinusoidal positions.
        dtype: cache dtype; default the dtype of the model's token embedding.
    Returns:
        the caches, one per layer.
    """
    c = model.config
    if max_len < 1 or batch_size < 1:
        raise ValueError(f"KV cache needs batch_size >= 1 and max_len >= 1, got {batch_size}, {max_len}.")
    ref = model.tok_emb.weight
    dtype = dtype or ref.dtype
    caches = []
    for block in model.blocks:
        cache = KVCache(batch_size, c.n_kv_heads, max_len, c.head_dim, dtype, ref.device)
        block.attn.kv_cache = cache
        caches.append(cache)
    return caches


def clear_kv_cache(model: nn.Module) -> None:
    """Detach every layer's cache (the model goes back to full recomputation)."""
    for block in model.blocks:
        block.attn.kv_cache = None


def kv_cache_nbytes(model: nn.Module) -> int:
    """Total bytes of the caches attached to ``model`` (0 when none is)."""
    return sum(b.attn.kv_cache.nbytes for b in model.blocks if b.attn.kv_cache is not None)
