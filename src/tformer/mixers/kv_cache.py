"""The KV cache: keys and values of earlier tokens, kept so each new token costs O(n), not O(n²).

Without a cache, generating token ``t`` recomputes the keys and values of all ``t - 1`` earlier
tokens in every layer. They never change (a causal model's past does not depend on its future),
so we store them once. Each layer gets two buffers of shape ``(B, n_kv_heads, max_len, head_dim)``,
allocated before generation starts and written in place: no per-token allocation, no
concatenation. Only the ``n_kv_heads`` key/value heads are stored, so grouped-query attention
shrinks the cache by ``n_heads / n_kv_heads`` (Ainslie et al., 2023).

The cache is attention's inference state (see :mod:`tformer.mixers.base`): the caller owns it,
inside a :class:`~tformer.models.state.InferenceState`, so one model can serve many requests.
Attention hands each step's new keys and values to :meth:`KVCache.store` and attends over the
:class:`KeyView` it gets back; *how* they are written and read is the cache class's business
(HF's ``past_key_value.update(k, v, layer_idx)``):

- :class:`KVCache` (dynamic, eager): writes ``T`` tokens at the Python position ``step.start_pos``
  and returns the filled prefix ``(B, nkv, start_pos + T, hs)``; the queries are the last ``T``
  keys, so the attention kernel applies causality, the window and ALiBi by index.
- :class:`StaticKVCache` (static decoding, ``model.new_state(..., static=True)``): a decode step
  writes one token per row at the row's own index ``step.write_index (B,)`` and returns the whole
  preallocated buffer with the query's index per row, so no shape and no Python value changes from
  step to step and ``torch.compile`` captures the step once. Its prefill is the eager write.
- :class:`RowWriter` (``cache.rows(slots)``): a batched prefill into some rows of a larger cache
  (the server's pool), from position 0 or after a prefix the rows already hold.

Size: ``2 · n_layers · max_len · n_kv_heads · head_dim · bytes_per_element`` per sequence
(:func:`tformer.accounting.kv_cache_bytes`).
"""

from __future__ import annotations

import torch

from tformer.errors import InputError

Tensor = torch.Tensor


class KeyView:
    """What attention reads after a cache write: keys, values, and where the queries sit among them.

    Attributes:
        k, v: ``(B, nkv, m, hs)``.
        mask: bool ``(B, 1, 1|T, m)``, ``True`` = may attend (padding; in a static step also the
            keys after the query), or ``None``.
        query_index: ``None``: the ``T`` queries are the last ``T`` of the ``m`` keys (the kernel's
            bottom-right alignment places causality, the window and ALiBi). A ``(B,)`` tensor: the
            one query of row ``b`` sits at key index ``query_index[b]`` (a static step).
    """

    __slots__ = ("k", "v", "mask", "query_index")   # one per layer per token: kept as cheap as a tuple

    def __init__(self, k: Tensor, v: Tensor, mask: Tensor | None = None, query_index: Tensor | None = None):
        self.k, self.v, self.mask, self.query_index = k, v, mask, query_index

    def attention_arguments(self, *, causal: bool, window: int | None, alibi_slopes: Tensor | None,
                            backend: str, dtype: torch.dtype) -> dict:
        """Keyword arguments of :func:`tformer.ops.sdpa.scaled_dot_product_attention` for these keys.

        With ``query_index`` the window and ALiBi are measured from each row's query index:
        ``dist = query_index - j`` for key ``j``; the window keeps ``dist < window`` and ALiBi adds
        ``-slope_h · |dist|`` (a dense ``(B, nh, 1, m)`` bias in ``dtype``, the queries'), through the
        math or PyTorch kernel.
        """
        if self.query_index is None:
            return dict(mask=self.mask, causal=causal, window=window, alibi_slopes=alibi_slopes, backend=backend)
        mask, bias = self.mask, None                                           # (B, 1, 1, m)
        if window is not None or alibi_slopes is not None:
            keys = torch.arange(self.k.shape[2], device=self.k.device)
            dist = (self.query_index[:, None] - keys[None])[:, None, None, :]  # (B, 1, 1, m): query - key index
            if window is not None:
                mask = mask & (dist < window)
            if alibi_slopes is not None:
                bias = -alibi_slopes.to(dtype)[None, :, None, None] * dist.abs().to(dtype)
        return dict(mask=mask, bias=bias, backend="math" if backend == "math" else "torch")


class KVCache:
    """One layer's cache, written eagerly at Python positions.

    Args:
        batch_size: sequences decoded together.
        n_kv_heads: key/value heads of the layer.
        max_len: the most positions the cache can hold (prompt + new tokens).
        head_dim: width of one head.
        dtype: element type; the model's activation dtype.
        device: where the buffers live.
    """

    POSITION_DIMS = {"k": 2, "v": 2}       # InferenceState.rows narrows these to the positions kept

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

    def store(self, k: Tensor, v: Tensor, step) -> KeyView:
        """Attention's one call: write this step's ``k, v (B, nkv, T, hs)`` at ``step.start_pos`` and
        return every key held, ``(B, nkv, start_pos + T, hs)``, under ``step.mask``."""
        return KeyView(*self.update(step.start_pos, k, v), step.mask)

    def rows(self, slots: Tensor) -> "RowWriter":
        """A writer that prefills rows ``slots (b,)`` of this cache (from position 0, or after the
        prefix they hold: the writer state's ``length``)."""
        return RowWriter(self, slots)

    @property
    def nbytes(self) -> int:
        """Bytes held by this layer's two buffers."""
        return self.k.nbytes + self.v.nbytes


class StaticKVCache(KVCache):
    """A cache for static decoding: a decode step (``step.write_index`` set, ``T == 1``) writes row
    ``b``'s key and value at index ``write_index[b]`` and attention reads all ``max_len`` positions
    (the rest masked by ``step.mask``); a prefill (``write_index`` unset) is :class:`KVCache`'s."""

    def store(self, k: Tensor, v: Tensor, step) -> KeyView:
        if step.write_index is None:
            return super().store(k, v, step)
        index = step.write_index                                               # (B,)
        rows = torch.arange(k.shape[0], device=k.device)
        self.k[rows, :, index] = k[:, :, 0]                                    # (B, nkv, hs) scattered
        self.v[rows, :, index] = v[:, :, 0]
        return KeyView(self.k, self.v, step.mask, index)


class RowWriter:
    """Stands in for a cache during a batched prefill of rows ``slots (b,)`` of ``cache``: writes the
    new keys and values ``(b, nkv, T, hs)`` at ``start_pos .. start_pos + T - 1`` of those rows and
    returns every key they then hold, ``(b, nkv, start_pos + T, hs)``. From position 0 that is the
    new keys themselves; after ``start_pos`` held ones (a prefix copied in from the server's prefix
    cache) it is a gather of the rows' first ``start_pos + T`` positions."""

    def __init__(self, cache: KVCache, slots: Tensor):
        self.cache, self.slots = cache, slots

    def store(self, k: Tensor, v: Tensor, step) -> KeyView:
        start, T = step.start_pos, k.shape[2]
        if start + T > self.cache.max_len:
            raise InputError(f"a row writer cannot write {T} tokens after {start} into rows of "
                             f"{self.cache.max_len} positions; make the pool with a larger max_len.")
        self.cache.k[self.slots, :, start:start + T] = k                       # (b, nkv, T, hs) scattered
        self.cache.v[self.slots, :, start:start + T] = v
        if start == 0:
            return KeyView(k, v, step.mask)
        return KeyView(self.cache.k[self.slots, :, :start + T], self.cache.v[self.slots, :, :start + T], step.mask)

    @property
    def nbytes(self) -> int:
        return 0                                                               # it holds nothing of its own
