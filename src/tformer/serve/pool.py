"""A preallocated pool of per-sequence inference states, and the two model calls the scheduler makes.

The pool holds ``n_slots`` rows of keys and values per layer, ``(n_slots, n_kv_heads, max_len,
head_dim)``, allocated once. A request owns one row (its *slot*) from admission until it
finishes; nothing is allocated per token or per request.

- :meth:`KVPool.prefill` runs one prompt (batch 1) and writes its keys/values into its slot's row.
- :meth:`KVPool.decode` runs one new token for every row ``0 .. hi-1`` at once. Rows hold
  different numbers of tokens, so each row writes at its own index ``length[row]`` and reads its
  keys under a padding mask ``key_j valid iff j <= length[row]``; its position is derived from the
  same mask (``cumsum - 1`` = ``length[row]``). Idle rows in that range compute a throw-away
  token (their slot is overwritten by the next prefill); keeping the range contiguous lets every
  layer read its keys as a view, without gathering rows.

Why rows of different lengths give the same tokens as each row alone: a masked key gets weight
exactly 0, and positions (learned, sinusoidal, RoPE) come per row from the mask. ALiBi adds
``-slope·(m-1-j)`` instead of ``-slope·(length-j)``; the difference is constant along the row, and
softmax ignores a constant. A sliding window counts from index ``m-1``, which is wrong for shorter
rows, so windowed models are refused.
"""

from __future__ import annotations

import torch

from tformer.errors import ConfigError

Tensor = torch.Tensor


class _LayerView(torch.nn.Module):
    """What a layer's attention sees as its ``kv_cache``: writes go into the pool's row(s)."""

    def __init__(self, pool: "KVPool", layer: int):
        super().__init__()
        self.pool, self.layer = pool, layer

    def update(self, start_pos: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        K, V, p = self.pool.k[self.layer], self.pool.v[self.layer], self.pool
        if p.prefill_slot is not None:                      # k (1, nkv, T, hs) at start_pos..
            end, s = start_pos + k.shape[2], p.prefill_slot
            K[s, :, start_pos:end], V[s, :, start_pos:end] = k[0], v[0]
            return K[s:s + 1, :, :end], V[s:s + 1, :, :end]
        rows = torch.arange(k.shape[0], device=k.device)   # k (hi, nkv, 1, hs) at length[row]
        K[rows, :, p.write], V[rows, :, p.write] = k[:, :, 0], v[:, :, 0]
        return K[:k.shape[0], :, :p.m], V[:k.shape[0], :, :p.m]   # (hi, nkv, m, hs) views


class KVPool:
    """``n_slots`` key/value rows of ``max_len`` positions for ``model`` (a DecoderLM).

    Args:
        model: the language model; the pool attaches itself to its attention layers.
        n_slots: the most sequences held at once.
        max_len: positions per slot (at most ``config.context_length``).
    """

    def __init__(self, model, n_slots: int, max_len: int):
        c = model.config
        if c.sliding_window is not None:
            raise ConfigError(f"the server's batched decode does not support sliding_window={c.sliding_window} "
                              f"yet; serve a model without a sliding window.")
        ref = model.tok_emb.weight
        shape = (c.n_layers, n_slots, c.n_kv_heads, max_len, c.head_dim)
        self.k = torch.zeros(shape, dtype=ref.dtype, device=ref.device)
        self.v = torch.zeros(shape, dtype=ref.dtype, device=ref.device)
        self.model, self.n_slots, self.max_len, self.device = model, n_slots, max_len, ref.device
        self.prefill_slot: int | None = None
        self.write: Tensor | None = None      # (hi,) decode write index per row
        self.m = 0                            # keys each row may read in this decode step
        self.attach()

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def attach(self) -> None:
        """Make every attention layer read and write this pool."""
        for i, block in enumerate(self.model.blocks):
            block.attn.kv_cache = _LayerView(self, i)

    def close(self) -> None:
        """Detach the pool: the model computes without a cache again."""
        for block in self.model.blocks:
            block.attn.kv_cache = None

    @torch.inference_mode()
    def prefill(self, slot: int, ids: Tensor) -> Tensor:
        """Write the prompt ``ids (T,)`` into ``slot``; return the next-token logits ``(vocab,)``."""
        self.attach()
        self.prefill_slot = slot
        try:
            logits, _ = self.model(ids[None], last_only=True)                 # (1, 1, vocab)
        finally:
            self.prefill_slot = None
        return logits[0, -1]

    @torch.inference_mode()
    def decode(self, tokens: Tensor, lengths: Tensor) -> Tensor:
        """One step for rows ``0 .. hi-1``: ``tokens (hi,)`` at index ``lengths (hi,)``; logits ``(hi, vocab)``."""
        self.attach()
        self.write, self.m = lengths, int(lengths.max()) + 1
        keys = torch.arange(self.m, device=self.device)                        # (m,)
        mask = (keys[None, :] <= lengths[:, None]).long()                       # (hi, m)
        logits, _ = self.model(tokens[:, None], attention_mask=mask, start_pos=self.m - 1, last_only=True)
        return logits[:, -1]                                                    # (hi, vocab)
