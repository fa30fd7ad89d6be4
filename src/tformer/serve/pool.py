"""A preallocated pool of per-sequence inference states, and the two model calls the scheduler makes.

The pool is ONE :class:`~tformer.inference.state.InferenceState` from ``model.new_state(n_slots,
max_len)``, made at start: row ``r`` of every layer's state (a KV cache ``(n_slots, n_kv_heads,
max_len, head_dim)``, or another mixer's state) belongs to the request in slot ``r`` from admission
until it finishes. Nothing is allocated per token or per request.

- :meth:`KVPool.prefill` runs one prompt through the model's eager path with a batch-1 *row view*
  of the pool (every layer's tensors sliced ``[slot:slot+1]``: views, so the writes land in the
  pool) and returns the next-token logits.
- :meth:`KVPool.decode` runs the model's static decode step (``slot=``) on a view of rows
  ``0 .. hi-1``: row ``r`` feeds its last token at position ``length[r]``, writes its keys and values
  at index ``length[r]``, and reads keys ``j <= length[r]`` that ``state.valid`` marks real. Rows of
  different lengths therefore decode together exactly. Idle rows inside the range compute a
  throw-away token (their slot is re-initialised at its next admission); keeping the range
  contiguous avoids gathering rows, and stopping at ``hi`` avoids computing rows past the last one
  in use. The step reads the first multiple of 64 positions that covers the longest row, not all
  ``max_len``, so short sequences do not pay for attention over the whole context; shapes change
  only every 64 tokens.
"""

from __future__ import annotations

import copy

import torch

from tformer.inference.state import InferenceState

Tensor = torch.Tensor
KEY_BUCKET = 64     # decode reads the first multiple of 64 positions that holds every row's keys


def _rows(layer_state, n: int, max_len: int, rows: slice, keys: int):
    """A shallow copy of one layer's state whose tensors are views: batch-leading ones cut to
    ``[rows]``, and position-indexed ones (``(B, h, max_len, d)``: KV caches) to their first ``keys``."""
    if layer_state is None:
        return None
    view = copy.copy(layer_state)
    for name, value in vars(layer_state).items():
        if isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == n:
            value = value[rows]
            if value.dim() == 4 and value.shape[2] == max_len:
                value = value[:, :, :keys]
            setattr(view, name, value)
    return view


class KVPool:
    """``n_slots`` rows of per-sequence state, ``max_len`` positions each, for ``model`` (a DecoderLM).

    Args:
        model: the language model (it holds no state; the pool does).
        n_slots: the most sequences held at once.
        max_len: positions per slot (at most what the model's positions allow).
    """

    def __init__(self, model, n_slots: int, max_len: int):
        self.model, self.n_slots, self.max_len = model, n_slots, max_len
        self.state = model.new_state(n_slots, max_len)
        self.device = model.tok_emb.weight.device
        self._views: dict[tuple[int, int], InferenceState] = {}

    @property
    def nbytes(self) -> int:
        return self.state.nbytes

    def view(self, start: int, stop: int, keys: int | None = None) -> InferenceState:
        """Rows ``start .. stop-1`` and positions ``0 .. keys-1`` of the pool as an InferenceState of
        their own (views into the pool; cached, so a step builds nothing)."""
        keys = keys or self.max_len
        key = (start, stop, keys)
        if key not in self._views:
            rows = slice(start, stop)
            layers = [_rows(s, self.n_slots, self.max_len, rows, keys) for s in self.state.layers]
            v = InferenceState.__new__(InferenceState)
            v.layers, v.batch_size, v.max_len = layers, stop - start, keys
            v.length, v.valid = 0, self.state.valid[rows, :keys]
            self._views[key] = v
        return self._views[key]

    @torch.inference_mode()
    def prefill(self, slot: int, ids: Tensor) -> Tensor:
        """Write the prompt ``ids (T,)`` into ``slot``; return the next-token logits ``(vocab,)``."""
        row = self.view(slot, slot + 1)
        row.reset()                                            # forget the slot's previous occupant
        logits, _ = self.model(ids[None], state=row, last_only=True)           # (1, 1, vocab)
        return logits[0, -1]

    @torch.inference_mode()
    def decode(self, tokens: Tensor, lengths: Tensor) -> Tensor:
        """One static step for rows ``0 .. hi-1``: ``tokens (hi,)`` at index ``lengths (hi,)``; logits ``(hi, vocab)``."""
        need = int(lengths.max()) + 1                     # keys the longest row reads after this write
        keys = min(self.max_len, -(-need // KEY_BUCKET) * KEY_BUCKET)
        rows = self.view(0, tokens.shape[0], keys)
        logits, _ = self.model(tokens[:, None], positions=lengths[:, None], state=rows, slot=lengths)
        return logits[:, -1]                                                    # (hi, vocab)
