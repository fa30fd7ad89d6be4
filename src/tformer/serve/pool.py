"""A preallocated pool of per-sequence inference states, and the two model calls the scheduler makes
(both through the public pair :mod:`tformer.generation.step`).

The pool is ONE static :class:`~tformer.models.state.InferenceState` from ``model.new_state(n_slots,
max_len, static=True)``, made at start: row ``r`` of every layer's state (a KV cache ``(n_slots,
n_kv_heads, max_len, head_dim)``, or another mixer's state) belongs to the request in slot ``r``
from admission until it finishes. Nothing is allocated per token.

Row ``r`` keeps its tokens at cache indices ``0 .. n-1`` (no padding inside a row), so a row's
length, its next write index and its next position are all ``n = state.valid[r].sum()``: the pool
reads lengths from ``valid`` and keeps no count of its own.

- :meth:`KVPool.prefill` writes several prompts in ONE forward
  (:func:`tformer.generation.step.prefill` on ``state.writer(rows)``): the prompts are
  *right*-padded to the longest, ``(b, T)``, and each layer's keys and values go straight into the
  pool rows of their slots. Right padding changes no real token's output: a causal model's token
  ``t`` reads only keys ``j <= t``, which are the prompt's own, so the pad tokens after a prompt are
  invisible to it (they compute throw-away values, which ``valid`` then marks as not real and the
  row's next tokens overwrite). Each prompt's next-token logits are taken at its own last token.
  This needs every layer's state to be a KV cache (a recurrent state would absorb the pads); a model
  with another mixer prefills one prompt at a time, through a batch-1 row view of the pool.
- :meth:`KVPool.decode` runs the static decode step (:func:`tformer.generation.step.decode_step` on
  the static pool state's ``rows(0, hi, keys)`` view, its ``index`` set to each row's length): row
  ``r`` feeds its last token at position ``n_r``, writes its key and value at index ``n_r``, and
  reads keys ``j <= n_r`` that ``valid`` marks real. Rows of different lengths therefore decode
  together exactly. Idle rows inside the range write at index 0 and compute a throw-away token
  (their row is re-initialised at its next admission); keeping the range contiguous avoids gathering
  rows, and stopping at ``hi`` avoids computing rows past the last one in use. The step reads the
  first multiple of 64 positions that covers the longest row, not all ``max_len``, so short
  sequences do not pay for attention over the whole context; shapes change only every 64 tokens.

**Prefix caching** (``prefix_cache_mb > 0``, KV-cache models): before a prefill each prompt looks up
the cached blocks it begins with (:class:`tformer.serve.prefix_cache.PrefixCache`, at most the blocks
before its last token, which must be computed for its logits), their keys and values are copied into
its row at positions ``0 .. c-1``, and only the suffix is prefilled, at positions ``c ..`` through
``state.writer(rows, start=c)``, one batched forward per distinct ``c``. Afterwards the prompt's full
blocks, and when a sequence ends the full blocks of everything its row holds (:meth:`KVPool.release`
with its tokens: a multi-turn chat's next request resends them), go into the store.

**Speculative steps** (:meth:`KVPool.verify`): one row feeds its last token and ``k`` drafts at
positions ``n .. n+k`` through :func:`tformer.generation.step.extend` on the row's view, and
:meth:`KVPool.keep` forgets the rejected drafts.
"""

from __future__ import annotations

import torch

from tformer.generation.step import decode_step, extend, prefill
from tformer.models.state import InferenceState
from tformer.serve.prefix_cache import PrefixCache

Tensor = torch.Tensor
KEY_BUCKET = 64     # decode reads the first multiple of 64 positions that holds every row's keys
PREFIX_BLOCK = 16   # tokens per prefix-cache block
SCORE_FLOATS = 2**25    # logits one scoring forward keeps (128 MiB of float32; its log-softmax as much again)


class KVPool:
    """``n_slots`` rows of per-sequence state, ``max_len`` positions each, for ``model`` (a DecoderLM).

    Args:
        model: the language model (it holds no state; the pool does).
        n_slots: the most sequences held at once.
        max_len: positions per slot (at most what the model's positions allow).
        prefix_cache_mb: MiB of KV blocks kept for prefix reuse (0: none; ignored for a model whose
            layers are not all KV caches).
        metrics: where the prefix cache counts hits and misses (a serve ``Metrics``), or None.
    """

    def __init__(self, model, n_slots: int, max_len: int, prefix_cache_mb: float = 0, metrics=None):
        self.model, self.n_slots, self.max_len = model, n_slots, max_len
        self.state = model.new_state(n_slots, max_len, static=True)              # every row decodes statically
        self.device = self.state.valid.device
        self.active = torch.zeros(n_slots, dtype=torch.bool, device=self.device)   # rows held by a sequence
        self.batched_prefill = bool(model.config.causal) and all(hasattr(s, "rows") for s in self.state.layers)
        self._views: dict[tuple[int, int, int], InferenceState] = {}
        self.prefix = (PrefixCache(PREFIX_BLOCK, int(prefix_cache_mb * 2**20), metrics)
                       if prefix_cache_mb > 0 and self.batched_prefill and
                       all(hasattr(s, "k") and hasattr(s, "v") for s in self.state.layers) else None)

    @property
    def nbytes(self) -> int:
        return self.state.nbytes

    def report(self, metrics) -> None:
        """The prefix cache's gauges (blocks held, their bytes, blocks pinned by an admission)."""
        if self.prefix is not None:
            metrics.set("tformer_prefix_cache_blocks", len(self.prefix), help="KV blocks held by the prefix cache")
            metrics.set("tformer_prefix_cache_bytes", self.prefix.nbytes, help="bytes of KV blocks in the prefix cache")
            metrics.set("tformer_prefix_cache_blocks_pinned", self.prefix.pinned,
                        help="prefix-cache blocks an admission is copying (0 between steps)")

    def lengths(self, stop: int | None = None) -> Tensor:
        """Tokens held by rows ``0 .. stop-1``, ``(stop,)``, read from ``valid`` (0 for idle rows)."""
        return self.state.valid[:stop].sum(-1) * self.active[:stop]

    def view(self, start: int, stop: int, keys: int | None = None) -> InferenceState:
        """Rows ``start .. stop-1`` and positions ``0 .. keys-1`` of the pool as an InferenceState of
        their own (views into the pool; cached, so a step builds nothing)."""
        key = (start, stop, keys or self.max_len)
        if key not in self._views:
            self._views[key] = self.state.rows(start, stop, keys)
        return self._views[key]

    def release(self, slot: int, tokens: list[int] | None = None) -> None:
        """``slot``'s sequence left: the row idles (and is overwritten at its next admission). With
        ``tokens`` (what the row holds, in order) its full blocks go into the prefix cache first."""
        if self.prefix is not None and tokens:
            n = min(len(tokens), int(self.lengths(self.n_slots)[slot]))
            with torch.inference_mode():
                self.prefix.insert(tokens, n // self.prefix.block, lambda a, b: self._read_row(slot, a, b))
        self.active[slot] = False

    @torch.inference_mode()
    def prefill(self, slots: list[int], prompts: list[list[int]]) -> Tensor:
        """Write ``prompts`` into rows ``slots`` (emptying them first); return each prompt's
        next-token logits, ``(len(slots), vocab)``."""
        if not self.batched_prefill:
            return torch.cat([self._prefill_one(s, p) for s, p in zip(slots, prompts)])
        if self.prefix is None:
            return self._prefill_rows(slots, prompts, 0)
        block = self.prefix.block
        found = [self.prefix.match(p, (len(p) - 1) // block) for p in prompts]     # never the last token
        try:
            starts = []
            for slot, blocks in zip(slots, found):
                self._copy_in(slot, blocks)
                starts.append(len(blocks) * block)
            order, parts = [], []
            for start in sorted(set(starts)):                               # one forward per cached length
                group = [i for i, s in enumerate(starts) if s == start]
                parts.append(self._prefill_rows([slots[i] for i in group], [prompts[i] for i in group], start))
                order += group
            logits = torch.cat(parts)[torch.argsort(torch.tensor(order))]   # (b, vocab) in the callers' order
            for slot, p in zip(slots, prompts):
                self.prefix.insert(p, len(p) // block, lambda a, b, slot=slot: self._read_row(slot, a, b))
        finally:
            for blocks in found:
                self.prefix.unpin(blocks)
        return logits

    def _prefill_rows(self, slots: list[int], prompts: list[list[int]], start: int, every: bool = False) -> Tensor:
        """One batched forward of the prompts' tokens after ``start`` (which rows ``slots`` already
        hold), right-padded; rows then hold their whole prompts. Returns ``(b, vocab)``, or with ``every``
        the logits at every position, ``(b, T, vocab)``."""
        b, T = len(prompts), max(len(p) for p in prompts) - start
        ids = torch.zeros(b, T, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, :len(p) - start] = torch.tensor(p[start:])                  # right padding with token 0
        n = torch.tensor([len(p) for p in prompts], device=self.device)         # (b,) real tokens per row
        rows = torch.tensor(slots, device=self.device)
        if every:
            logits, _ = self.model(ids.to(self.device), state=self.state.writer(rows, start))    # (b, T, vocab)
        else:
            logits = prefill(self.model, ids.to(self.device), self.state.writer(rows, start),
                             last_index=n - 1 - start)                          # (b, vocab)
        self.state.hold(rows, n)                                                # the rows hold their prompts only
        self.active[rows] = True
        return logits

    @torch.inference_mode()
    def score(self, slots: list[int], prompts: list[list[int]], top: int) -> tuple[Tensor, list[list[tuple]]]:
        """Write ``prompts`` into rows ``slots`` as :meth:`prefill` does, keeping the logits at EVERY
        position: the prompt's own log-probabilities (``echo`` with ``logprobs``, what lm-eval scores).

        Returns ``(next-token logits (b, vocab), per prompt [(token, logprob, top)] for tokens 1 .. n-1)``,
        ``logprob = log softmax(logits at t - 1)[token t]`` and ``top`` its ``top`` best ``(id, logprob)``
        (``None`` when ``top`` is 0). Prompts are grouped so that a forward's logits stay under
        :data:`SCORE_FLOATS` floats; the prompts' blocks then go into the prefix cache for later requests
        (a scoring request computes every position, so it reads none from it).
        """
        vocab, out_logits, entries = self.model.config.vocab_size, [None] * len(slots), [None] * len(slots)
        order = sorted(range(len(slots)), key=lambda i: len(prompts[i]))
        groups, group = [], []
        for i in order:                                                  # shortest first: little padding
            if group and (len(group) + 1) * len(prompts[i]) * vocab > SCORE_FLOATS:
                groups.append(group)
                group = []
            group.append(i)
        groups.append(group)
        for group in groups:
            T = max(len(prompts[i]) for i in group)
            logits = self._prefill_rows([slots[i] for i in group], [prompts[i] for i in group], 0, every=True)
            logp = torch.log_softmax(logits[:, :-1].float(), dim=-1) if T > 1 else None     # (b, T-1, vocab)
            for r, i in enumerate(group):
                out_logits[i] = logits[r, len(prompts[i]) - 1]
                m = len(prompts[i]) - 1
                if m == 0:
                    entries[i] = []
                    continue
                lp = logp[r, :m]                                               # (m, vocab) predicting 1 .. m
                tok = torch.tensor(prompts[i][1:], device=lp.device)
                chosen = lp.gather(1, tok[:, None])[:, 0].tolist()
                if top:
                    tv, ti = lp.topk(top, dim=-1)
                    tops = [list(zip(a, v)) for a, v in zip(ti.tolist(), tv.tolist())]
                else:
                    tops = [None] * m
                entries[i] = list(zip(prompts[i][1:], chosen, tops))
        if self.prefix is not None:
            for slot, p in zip(slots, prompts):
                self.prefix.insert(p, len(p) // self.prefix.block, lambda a, b, slot=slot: self._read_row(slot, a, b))
        return torch.stack(out_logits), entries

    def _copy_in(self, slot: int, blocks: list) -> None:
        """Copy cached ``blocks`` (a chain from position 0) into row ``slot``'s keys and values."""
        if not blocks:
            return
        data = torch.cat([b.data for b in blocks], dim=3)                      # (L, 2, nkv, c, hs)
        c = data.shape[3]
        for layer, kv in zip(self.state.layers, data):
            layer.k[slot, :, :c] = kv[0]
            layer.v[slot, :, :c] = kv[1]

    def _read_row(self, slot: int, a: int, b: int) -> Tensor:
        """Row ``slot``'s keys and values at positions ``a .. b-1``: ``(L, 2, nkv, b - a, hs)``."""
        return torch.stack([torch.stack([layer.k[slot, :, a:b], layer.v[slot, :, a:b]]) for layer in self.state.layers])

    @torch.inference_mode()
    def verify(self, slot: int, tokens: list[int]) -> Tensor:
        """Feed ``tokens`` (the row's last token and ``k >= 1`` drafts) at positions ``n .. n+k`` of
        row ``slot`` (``n`` the tokens it holds) in one forward; return the logits after each,
        ``(k+1, vocab)``. The row then holds them all: call :meth:`keep` to drop rejected ones."""
        n = int(self.lengths(self.n_slots)[slot])
        row = self.view(slot, slot + 1)
        row.length = n                                                          # an eager call writes at n
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        return extend(self.model, ids, row)[0]                                  # (k+1, vocab)

    def keep(self, slot: int, n: int) -> None:
        """Row ``slot`` keeps its first ``n`` tokens (a speculative step's accepted ones)."""
        self.view(slot, slot + 1).truncate(n)

    def _prefill_one(self, slot: int, prompt: list[int]) -> Tensor:
        """One prompt through the eager path on a batch-1 row view (any mixer's state)."""
        row = self.view(slot, slot + 1)
        row.reset()                                            # forget the slot's previous occupant
        ids = torch.tensor([prompt], dtype=torch.long, device=self.device)
        logits = prefill(self.model, ids, row)                                  # (1, vocab)
        self.active[slot] = True
        return logits

    @torch.inference_mode()
    def decode(self, tokens: Tensor, need: int) -> Tensor:
        """One static step for rows ``0 .. hi-1``: row ``r`` feeds ``tokens[r]`` at index and position
        ``lengths()[r]``; ``need`` (a Python int) bounds the keys any row reads after its write.
        Returns the logits ``(hi, vocab)``."""
        hi = tokens.shape[0]
        keys = min(self.max_len, -(-need // KEY_BUCKET) * KEY_BUCKET)
        at = self.lengths(hi)                                                   # (hi,) write index = position
        rows = self.view(0, hi, keys)
        rows.index.copy_(at)                                                    # idle rows write at 0
        return decode_step(self.model, tokens[:, None], rows, positions=at[:, None])   # (hi, vocab)
