"""Automatic prefix caching: the KV state of token blocks that earlier requests computed, found by
their tokens, so a request sharing a prefix (the chat template's system prompt, a multi-turn chat's
history) copies it in instead of recomputing it.

A sequence's tokens are cut into blocks of ``block`` tokens. Block ``i`` is identified by its own
tokens *and* the block before it: its key is ``(id of block i-1, tokens of block i)``, so equal keys
mean equal tokens at positions ``0 .. (i+1)·block - 1`` (vLLM's chained block hashes; here the key
holds the tokens themselves, so two different prefixes can never share a block, not even by a hash
collision). A block's data is the keys and values of its positions in every layer,
``(n_layers, 2, n_kv_heads, block, head_dim)``: a causal model's keys at a position depend only on
the tokens up to it, so they are the same in any request with that prefix.

The store is bounded by bytes: inserting past the budget evicts the least recently used block that
no other block continues (a *leaf*, so every cached block stays reachable from the first block) and
that no admission is copying (``pins``). Lookups and inserts run on the scheduler thread only.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import torch

Tensor = torch.Tensor


class Block:
    """One cached block: its key, KV data, the block it continues, and who depends on it."""

    __slots__ = ("id", "key", "data", "parent", "children", "pins")

    def __init__(self, id: int, key: tuple, data: Tensor, parent: "Block | None"):
        self.id, self.key, self.data, self.parent = id, key, data, parent
        self.children, self.pins = 0, 0


class PrefixCache:
    """Blocks of ``block`` tokens' KV state, at most ``budget_bytes`` in all.

    Args:
        block: tokens per block.
        budget_bytes: the most bytes of block data held (evicting least recently used leaves).
        metrics: a :class:`tformer.serve.metrics.Metrics` for the hit / miss counters, or None.
    """

    def __init__(self, block: int, budget_bytes: int, metrics=None):
        if block < 1 or budget_bytes < 1:
            raise ValueError(f"a prefix cache needs block >= 1 and a budget >= 1 byte, got {block}, {budget_bytes}.")
        self.block, self.budget, self.metrics = block, budget_bytes, metrics
        self.index: dict[tuple, Block] = {}
        self.lru: OrderedDict[int, Block] = OrderedDict()              # oldest first
        self.nbytes = 0
        self.next_id = 0

    # ------------------------------------------------------------------ reading
    def key(self, parent: Block | None, tokens: list[int], i: int) -> tuple:
        return (parent.id if parent is not None else -1, tuple(tokens[i * self.block:(i + 1) * self.block]))

    def match(self, tokens: list[int], max_blocks: int) -> list[Block]:
        """The cached blocks that begin ``tokens``, at most ``max_blocks``, pinned (give them back
        with :meth:`unpin` once their data is copied). Counts the hits and misses."""
        found: list[Block] = []
        while len(found) < max_blocks:
            b = self.index.get(self.key(found[-1] if found else None, tokens, len(found)))
            if b is None:
                break
            found.append(b)
        for b in reversed(found):                                          # parents end up the most recent
            b.pins += 1
            self.lru.move_to_end(b.id)
        if self.metrics is not None:
            m = self.metrics
            m.inc("tformer_prefix_cache_queries_total", help="prompts looked up in the prefix cache")
            m.inc("tformer_prefix_cache_hit_blocks_total", len(found), help="prompt blocks found in the prefix cache")
            m.inc("tformer_prefix_cache_miss_blocks_total", max_blocks - len(found),
                  help="full prompt blocks not in the prefix cache (prefilled)")
            m.inc("tformer_prefix_cache_hit_tokens_total", len(found) * self.block,
                  help="prompt tokens whose KV state was copied from the prefix cache instead of computed")
        return found

    @staticmethod
    def unpin(blocks: list[Block]) -> None:
        for b in blocks:
            b.pins -= 1

    @property
    def pinned(self) -> int:
        """Blocks an admission holds right now (0 between scheduler steps)."""
        return sum(1 for b in self.lru.values() if b.pins)

    def __len__(self) -> int:
        return len(self.lru)

    # ------------------------------------------------------------------ writing
    def insert(self, tokens: list[int], n_blocks: int, read: Callable[[int, int], Tensor]) -> int:
        """Cache the first ``n_blocks`` full blocks of ``tokens``. ``read(a, b)`` returns the KV data
        of positions ``a .. b-1`` as ``(n_layers, 2, n_kv_heads, b - a, head_dim)``; it is called once,
        for the blocks not cached yet. Stops early when the budget cannot be met by evicting.
        Returns the blocks added."""
        chain: list[Block] = []
        while len(chain) < n_blocks:                                        # the part already cached
            b = self.index.get(self.key(chain[-1] if chain else None, tokens, len(chain)))
            if b is None:
                break
            chain.append(b)
        for b in chain:
            b.pins += 1                                                     # not evicted while we extend it
        first, added = len(chain), 0
        try:
            if first < n_blocks:
                data = read(first * self.block, n_blocks * self.block)    # (L, 2, nkv, n·block, hs)
                for i in range(first, n_blocks):
                    piece = data[:, :, :, (i - first) * self.block:(i - first + 1) * self.block].clone()
                    if not self._make_room(piece.nbytes):
                        break
                    parent = chain[-1] if chain else None
                    b = Block(self.next_id, self.key(parent, tokens, i), piece, parent)
                    self.next_id += 1
                    self.index[b.key], self.lru[b.id] = b, b
                    self.nbytes += piece.nbytes
                    if parent is not None:
                        parent.children += 1
                    b.pins += 1
                    chain.append(b)
                    added += 1
            for b in reversed(chain):
                self.lru.move_to_end(b.id)
        finally:
            self.unpin(chain)
        return added

    def _make_room(self, nbytes: int) -> bool:
        """Evict least recently used unpinned leaves until ``nbytes`` more fit the budget."""
        while self.nbytes + nbytes > self.budget:
            victim = next((b for b in self.lru.values() if b.children == 0 and b.pins == 0), None)
            if victim is None:
                return False
            self._evict(victim)
        return True

    def _evict(self, b: Block) -> None:
        del self.index[b.key], self.lru[b.id]
        self.nbytes -= b.data.nbytes
        if b.parent is not None:
            b.parent.children -= 1
        if self.metrics is not None:
            self.metrics.inc("tformer_prefix_cache_evicted_blocks_total", help="blocks evicted from the prefix cache")

    def clear(self) -> None:
        self.index.clear()
        self.lru.clear()
        self.nbytes = 0
