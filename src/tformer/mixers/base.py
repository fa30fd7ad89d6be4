"""The token-mixer protocol: what every layer that lets tokens talk to each other provides.

A :class:`~tformer.models.block.Block` is ``mixer`` then ``feed-forward``, each a residual sub-layer.
The mixer is chosen per layer by the config (``TransformerConfig.mixer``) through the registry in
``tformer.mixers``; softmax attention is one mixer among others (sparse and linear attention,
state-space layers). A mixer class:

- is built as ``Mixer(config, layer, shared)``: ``layer`` is its index in the stack, ``shared`` a
  :class:`Shared` with objects every layer reuses (the rotary table);
- runs as ``mixer(x, step, state)`` with ``x (B, T, C)`` and returns ``(B, T, C)`` (or
  ``(out, weights)`` when ``step.return_weights`` and the mixer has weights to show);
- makes its own inference state with ``new_state(batch_size, max_len, dtype, device)`` (a KV
  cache, a ring buffer, a fixed-size recurrent state, or ``None``) and, optionally, the state for
  static decoding with ``new_static_state(batch_size, max_len, dtype, device)`` (a mixer without it
  gets its ``new_state`` in static decoding too). See *What a state provides* below;
- tells the accounting its size from the config alone: ``count_parameters(config)`` and
  ``state_bytes(config, n_tokens, batch_size, bytes_per_element)`` (class methods);
- marks each projection that writes into the residual stream with :func:`mark_residual`, so the
  model scales its initialisation by ``1/sqrt(2·n_layers)`` (GPT-2) whatever the mixer is.

The state belongs to the caller (one per request), never to the module: two generations on one
model each pass their own state.

What a state provides
---------------------
- ``nbytes`` (bytes it holds, for the accounting), and ``reset()`` if it must be zeroed to start a
  new sequence (a recurrent sum must; a KV cache need not, its stale entries are masked);
- its per-sequence tensors with the batch rows on dimension 0, or ``BATCH_DIMS = {"name": dim}``
  (beam search and the server's pool move rows through :meth:`InferenceState.map`), and, for
  tensors with a position axis the server may cut to the positions in use, ``POSITION_DIMS``;
- it is read and written only through the mixer's forward, which gets the :class:`Step`. Two kinds
  of call reach it: the *eager* one (``T`` tokens after ``step.start_pos``, a Python int), and, on a
  state made by ``model.new_state(..., static=True)``, the *static decode step*: one token per row,
  written at ``step.write_index (B,)``, with ``step.mask`` the real keys up to it, and nothing that
  changes between steps but tensor values, so ``torch.compile`` captures it once. The state class,
  not the mixer, tells the two apart (``KVCache`` / ``StaticKVCache`` in
  :mod:`tformer.mixers.kv_cache`). A state that depends only on the tokens it has seen (a running
  sum, Mamba's SSM state) serves both kinds unchanged; one that indexes positions (a KV cache, a
  ring buffer) needs its static class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

Tensor = torch.Tensor


@dataclass
class Step:
    """What a mixer may need beyond ``x``, computed once per model forward.

    Attributes:
        positions: ``(T,)`` or ``(B, T)`` absolute positions of the ``T`` new tokens.
        mask: bool key mask broadcastable to ``(B, 1, T, m)``, ``True`` = may attend; it hides
            padding only (causality and windows are the mixer's business; in a static decode step
            it also hides the keys after each row's ``write_index``). ``None``: no padding.
        tokens: ``(B, T)`` bool, ``True`` for real tokens among the new ones (``None``: all real);
            recurrent mixers zero padding with it so left padding changes nothing.
        start_pos: tokens the state held before this call (0 without a state); a Python int.
        write_index: ``(B,)`` int64, set only in a static decode step (``T == 1``): the index each
            row's new token is written at (its query's index among the keys). Mixers pass the step
            to their state and leave it to the state class; ``start_pos`` is then 0.
        dropout: apply dropout (training, no inference state).
        return_weights: also return attention weights (for attention maps).
        global_tokens: ``(B, T)`` bool, ``True`` for the new tokens the caller gives global
            attention (HF Longformer's ``global_attention_mask``); ``None``: none beyond a mixer's own.
        hooks: ``hooks(name, tensor) -> tensor``, called at every named hook point of the forward
            (``tformer.interp``: caches, interventions), or ``None``: no hook point is visited and
            the forward is the plain one (the only cost of hooks is this one test per module).
    """

    positions: Tensor
    mask: Tensor | None = None
    tokens: Tensor | None = None
    start_pos: int = 0
    write_index: Tensor | None = None
    dropout: bool = False
    return_weights: bool = False
    global_tokens: Tensor | None = None
    hooks: Callable[[str, Tensor], Tensor] | None = None


@dataclass
class Shared:
    """Objects built once per model and handed to every layer's mixer (e.g. the rotary table; the
    sliding-window layers' own table, ``local_rope``, where the config gives them a base of their own)."""

    rope: nn.Module | None = None
    local_rope: nn.Module | None = None
