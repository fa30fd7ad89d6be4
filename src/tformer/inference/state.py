"""Per-request inference state: everything a model remembers between calls while it generates.

One :class:`InferenceState` per request (or per batch of requests decoded together), made by
``model.new_state(batch_size, max_len)`` and owned by the caller; the model's modules hold none
of it, so one model object serves any number of interleaved generations.

    state.layers[i]   layer i's mixer state (attention: a KVCache; other mixers: their own)
    state.length      tokens written so far by the eager path (a Python int, same for every row)
    state.valid       (B, max_len) bool: which written positions are real tokens (not padding);
                      the static decode step reads it as its attention mask
"""

from __future__ import annotations

from typing import Any

import torch

Tensor = torch.Tensor


class InferenceState:
    """The layers' states of one request (or one batch), plus how much of them is filled.

    Args:
        layers: one entry per layer, from each mixer's ``new_state`` (``None`` for stateless mixers).
        batch_size: rows.
        max_len: the most positions any layer can hold.
        device: where ``valid`` lives.
    """

    def __init__(self, layers: list[Any], batch_size: int, max_len: int, device: torch.device | str | None = None):
        self.layers = layers
        self.batch_size, self.max_len = batch_size, max_len
        self.length = 0
        self.valid = torch.zeros(batch_size, max_len, dtype=torch.bool, device=device)

    def reset(self) -> None:
        """Forget every token (the buffers stay allocated; stale entries are masked out by ``valid``)."""
        self.length = 0
        self.valid.zero_()
        for s in self.layers:
            if hasattr(s, "reset"):
                s.reset()

    @property
    def nbytes(self) -> int:
        """Bytes of every layer's state (the validity mask is bookkeeping and not counted)."""
        return sum(s.nbytes for s in self.layers if s is not None)
