"""Per-request inference state: everything a model remembers between calls while it generates.

One :class:`InferenceState` per request (or per batch of requests decoded together), made by
``model.new_state(batch_size, max_len)`` and owned by the caller; the model's modules hold none
of it, so one model object serves any number of interleaved generations.

    state.layers[i]   layer i's mixer state (attention: a KVCache; other mixers: their own)
    state.length      tokens written so far by the eager path (a Python int, same for every row)
    state.valid       (B, max_len) bool: which written positions are real tokens (not padding);
                      the static decode step reads it as its attention mask

Rows of a state are rearranged (beam search repeats and reorders them) through :meth:`InferenceState.map`.
Every tensor attribute of a layer state holds one row per sequence along dimension 0, unless the
state's class names another dimension in ``BATCH_DIMS = {"attribute": dim}``.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

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

    def map(self, fn: Callable[[Tensor], Tensor]) -> "InferenceState":
        """A state whose row tensors are ``fn`` of these: every tensor attribute of every layer
        state, and ``valid``. ``fn`` gets each tensor with its batch rows along dimension 0
        (``(B, ...)`` -> ``(B', ...)``, e.g. ``repeat_interleave`` or a row gather); it may return a
        new tensor or write the given one in place and return it.

        The layer states are shallow copies, so this state keeps its own tensors unless ``fn``
        writes into them. Raises ``ValueError`` if a tensor's batch dimension is not ``batch_size``
        long (a layer state whose rows are not on dimension 0 must say so in ``BATCH_DIMS``).
        """
        def on_rows(t: Tensor, dim: int, where: str) -> Tensor:
            if t.dim() <= dim or t.shape[dim] != self.batch_size:
                raise ValueError(f"{where} of shape {tuple(t.shape)} has no batch dimension {dim} of "
                                 f"{self.batch_size} rows; declare its batch dimension in BATCH_DIMS.")
            return fn(t) if dim == 0 else fn(t.movedim(dim, 0)).movedim(0, dim)

        def map_layer(layer):
            if layer is None:
                return None
            new, dims = copy.copy(layer), getattr(layer, "BATCH_DIMS", {})
            for name, value in vars(layer).items():
                if isinstance(value, Tensor):
                    setattr(new, name, on_rows(value, dims.get(name, 0), f"{type(layer).__name__}.{name}"))
            return new

        valid = on_rows(self.valid, 0, "valid")                              # (B', max_len)
        new = InferenceState([map_layer(s) for s in self.layers], valid.shape[0], self.max_len, valid.device)
        new.length, new.valid = self.length, valid
        return new
