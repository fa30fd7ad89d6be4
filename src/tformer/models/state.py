"""Per-request inference state: everything a model remembers between calls while it generates.

One :class:`InferenceState` per request (or per batch of requests decoded together), made by
``model.new_state(batch_size, max_len)`` and owned by the caller; the model's modules hold none
of it, so one model object serves any number of interleaved generations.

    state.layers[i]   layer i's mixer state (attention: a KVCache; other mixers: their own)
    state.length      tokens written so far (a Python int, same for every row; on a static state
                      ``decode_step`` counts the static steps, which only move ``index``)
    state.valid       (B, max_len) bool: which written positions are real tokens (not padding);
                      the static decode step reads it as its attention mask
    state.static      made with ``static=True``: the layers hold their static classes
                      (:mod:`tformer.mixers.base`) and a one-token call is the static decode step
    state.index       (B,) int64, static states only: the next write index of each row
    state.padded      a call with an attention mask wrote into it, so a row may hold padding (a flag,
                      so that a call that needs rows without padding does not read ``valid`` back)

Rows of a state are rearranged (beam search repeats and reorders them) through :meth:`InferenceState.map`;
:meth:`InferenceState.rows` is a view of some rows and leading positions (the server decodes the
rows in use over the positions in use), :meth:`InferenceState.writer` a scratch state that prefills
some rows in one batched forward (from position 0 or after a prefix they hold), and
:meth:`InferenceState.truncate` forgets positions past a length (speculative decoding's rollback). Every tensor attribute of a layer state holds
one row per sequence along dimension 0, unless the state's class names another dimension in
``BATCH_DIMS = {"attribute": dim}``; ``POSITION_DIMS`` names the tensors with a position axis.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch

from tformer.errors import InputError

Tensor = torch.Tensor


class InferenceState:
    """The layers' states of one request (or one batch), plus how much of them is filled.

    Args:
        layers: one entry per layer, from each mixer's ``new_state`` (``None`` for stateless mixers).
        batch_size: rows.
        max_len: the most positions any layer can hold.
        device: where ``valid`` (and ``index``) live.
        static: the layers are static-decoding states; keep a per-row write ``index``.

    ``context`` is the ``max_len`` the state was made with, kept by its views (:meth:`rows` may cut
    ``max_len`` to fewer keys): the context a LongRoPE picks its set for (:mod:`tformer.nn.rope_scaling`).
    """

    def __init__(self, layers: list[Any], batch_size: int, max_len: int, device: torch.device | str | None = None,
                 *, static: bool = False):
        self.layers = layers
        self.batch_size, self.max_len, self.context = batch_size, max_len, max_len
        self.length = 0
        self.valid = torch.zeros(batch_size, max_len, dtype=torch.bool, device=device)
        self.static = static
        self.index = torch.zeros(batch_size, dtype=torch.long, device=device) if static else None
        self.padded = False

    def reset(self) -> None:
        """Forget every token (the buffers stay allocated; stale entries are masked out by ``valid``)."""
        self.length = 0
        self.padded = False
        self.valid.zero_()
        if self.index is not None:
            self.index.zero_()
        for s in self.layers:
            if hasattr(s, "reset"):
                s.reset()

    def advance(self, end: int) -> None:
        """After an eager call: every row holds ``end`` positions (a static state's ``index`` follows)."""
        self.length = end
        if self.index is not None:
            self.index.fill_(end)

    @property
    def nbytes(self) -> int:
        """Bytes of every layer's state (the validity mask is bookkeeping and not counted)."""
        return sum(s.nbytes for s in self.layers if s is not None)

    def map(self, fn: Callable[[Tensor], Tensor]) -> "InferenceState":
        """A state whose row tensors are ``fn`` of these: every tensor attribute of every layer
        state, ``valid`` and ``index``. ``fn`` gets each tensor with its batch rows along dimension 0
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
        index = None if self.index is None else on_rows(self.index, 0, "index")
        return self._assemble([map_layer(s) for s in self.layers], valid, index, self.max_len, self.length, self.padded,
                              self.context)

    def rows(self, start: int, stop: int, keys: int | None = None) -> "InferenceState":
        """Rows ``start .. stop-1`` and positions ``0 .. keys-1`` (default all) of this state, as a
        state of their own whose tensors are views into this one: what a call writes through it
        lands here. Tensors a layer state names in ``POSITION_DIMS`` are cut to ``keys`` positions.

        Raises:
            InputError: if the rows or ``keys`` are out of range.
        """
        keys = self.max_len if keys is None else keys
        if not (0 <= start < stop <= self.batch_size and 1 <= keys <= self.max_len):
            raise InputError(f"rows {start}..{stop - 1} and {keys} positions do not fit a state of "
                             f"{self.batch_size} rows x {self.max_len} positions.")
        view = self.map(lambda t: t[start:stop])
        for layer in view.layers:
            for name, dim in getattr(layer, "POSITION_DIMS", {}).items():
                setattr(layer, name, getattr(layer, name).narrow(dim, 0, keys))
            if layer is not None and hasattr(layer, "max_len"):
                layer.max_len = keys
        return self._assemble(view.layers, view.valid[:, :keys], view.index, keys, 0, self.padded, self.context)

    def writer(self, rows: Tensor, start: int = 0) -> "InferenceState":
        """A scratch state for an eager prefill of ``len(rows)`` sequences, written straight into rows
        ``rows (b,)`` of this state by every layer state's ``rows(rows)`` (a KV cache's
        :class:`~tformer.mixers.kv_cache.RowWriter`). With ``start > 0`` the rows already hold
        ``start`` real tokens at positions ``0 .. start-1`` (a prefix copied in) and the prefill
        continues after them (positions ``start ..``, attending to the prefix). Afterwards call
        :meth:`hold` to mark what the rows now contain.

        Raises:
            InputError: if a layer's state cannot write rows this way (a recurrent or ring state,
                which would absorb the padding of a batched prefill), or ``start`` is out of range.
        """
        if not all(hasattr(s, "rows") for s in self.layers):
            raise InputError("this state has a layer that cannot prefill rows in a batch (only KV caches can); "
                             "prefill one sequence at a time through rows(r, r + 1).")
        if not 0 <= start < self.max_len:
            raise InputError(f"a writer cannot start at position {start} of a state of {self.max_len} positions.")
        b = rows.shape[0]
        scratch = InferenceState([s.rows(rows) for s in self.layers], b, self.max_len, self.valid.device)
        scratch.length, scratch.context = start, self.context
        scratch.valid[:, :start] = True                                        # the held prefix is real
        return scratch

    def truncate(self, length: int) -> None:
        """Keep only the first ``length`` positions of every row (a speculative step rolls back the
        draft tokens it rejected): later entries are marked not real and are overwritten next, and
        a static state writes its next token at ``length``. Every row must hold at least
        ``length`` real tokens at ``0 .. length-1`` (no padding)."""
        if not 0 <= length <= self.max_len:
            raise InputError(f"cannot keep {length} positions of a state of {self.max_len}.")
        self.valid[:, length:] = False
        self.length = length
        if self.index is not None:
            self.index.fill_(length)

    def hold(self, rows: Tensor, lengths: Tensor) -> None:
        """Rows ``rows (b,)`` now hold ``lengths (b,)`` real tokens at positions ``0 .. n-1`` (and a
        static state writes their next token at ``n``)."""
        positions = torch.arange(self.max_len, device=self.valid.device)
        self.valid[rows] = positions[None] < lengths[:, None]                # (b, max_len)
        if self.index is not None:
            self.index[rows] = lengths

    @staticmethod
    def _assemble(layers: list, valid: Tensor, index: Tensor | None, max_len: int, length: int,
                  padded: bool, context: int) -> "InferenceState":
        new = InferenceState.__new__(InferenceState)
        new.layers, new.batch_size, new.max_len, new.length = layers, valid.shape[0], max_len, length
        new.context = context
        new.valid, new.static, new.index, new.padded = valid, index is not None, index, padded
        return new
