"""The KV cache: keys and values of earlier tokens, kept so each new token costs O(n), not O(n²).

Without a cache, generating token ``t`` recomputes the keys and values of all ``t - 1`` earlier
tokens in every layer. They never change (a causal model's past does not depend on its future),
so we store them once. Each layer gets two buffers of shape ``(B, n_kv_heads, max_len, head_dim)``,
allocated before generation starts and written in place: no per-token allocation, no
concatenation. Only the ``n_kv_heads`` key/value heads are stored, so grouped-query attention
shrinks the cache by ``n_heads / n_kv_heads`` (Ainslie et al., 2023).

The cache is attention's inference state (see :mod:`tformer.mixers.base`): the caller owns it,
inside a :class:`~tformer.models.state.InferenceState`, so one model can serve many requests.

Size: ``2 · n_layers · max_len · n_kv_heads · head_dim · bytes_per_element`` per sequence
(:func:`tformer.accounting.kv_cache_bytes`).
"""

from __future__ import annotations

import torch

from tformer.errors import InputError

Tensor = torch.Tensor


class KVCache:
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
        shape = (batch_size, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len

    def update(self, start_pos: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write ``k, v (B, nkv, T, hs)`` at positions ``start_pos .. start_pos + T - 1``.

        Returns:
            ``(k_all, v_all)``: views ``(B, nkv, start_pos + T, hs)`` of everything held so far.
        Raises:
            InputError: if the write would run past ``max_len`` or the batch size differs.
        """
        end = start_pos + k.shape[-2]
        if end > self.max_len or k.shape[0] != self.k.shape[0]:
            raise InputError(
                f"KV cache holds batch {self.k.shape[0]} x {self.max_len} positions; cannot write batch "
                f"{k.shape[0]} at positions {start_pos}..{end - 1}. Set up the cache with a larger max_len."
            )
        self.k[:, :, start_pos:end] = k
        self.v[:, :, start_pos:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]

    def write_slot(self, slot: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Static decode: write one token per sequence, ``k, v (B, nkv, 1, hs)``, at index ``slot (B,)``.

        Returns the whole buffers ``(B, nkv, max_len, hs)``; the caller masks what is not written yet.
        """
        rows = torch.arange(k.shape[0], device=k.device)
        self.k[rows, :, slot] = k[:, :, 0]                                    # (B, nkv, hs) scattered
        self.v[rows, :, slot] = v[:, :, 0]
        return self.k, self.v

    @property
    def nbytes(self) -> int:
        """Bytes held by this layer's two buffers."""
        return self.k.nbytes + self.v.nbytes
