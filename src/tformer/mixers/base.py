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
  cache, a ring buffer, a fixed-size recurrent state, or ``None``); the state has ``nbytes``;
- tells the accounting its size from the config alone: ``count_parameters(config)`` and
  ``state_bytes(config, n_tokens, batch_size, bytes_per_element)`` (class methods);
- marks each projection that writes into the residual stream with :func:`mark_residual`, so the
  model scales its initialisation by ``1/sqrt(2·n_layers)`` (GPT-2) whatever the mixer is.

The state belongs to the caller (one per request), never to the module: two generations on one
model each pass their own state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

Tensor = torch.Tensor


@dataclass
class Step:
    """What a mixer may need beyond ``x``, computed once per model forward.

    Attributes:
        positions: ``(T,)`` or ``(B, T)`` absolute positions of the ``T`` new tokens.
        mask: bool key mask broadcastable to ``(B, 1, T, m)``, ``True`` = may attend; it hides
            padding only (causality and windows are the mixer's business). ``None``: no padding.
        tokens: ``(B, T)`` bool, ``True`` for real tokens among the new ones (``None``: all real);
            recurrent mixers zero padding with it so left padding changes nothing.
        start_pos: tokens the state held before this call (0 without a state); a Python int.
        slot: ``(B,)`` int64 tensor: the static decode step's write index per sequence (``T == 1``).
            When set, a mixer updates its state in place at ``slot`` and reads the whole
            preallocated state under ``state``'s own validity mask: no Python ints that change
            from step to step, so ``torch.compile`` captures the step once.
        dropout: apply dropout (training, no inference state).
        return_weights: also return attention weights (for attention maps).
        global_tokens: ``(B, T)`` bool, ``True`` for the new tokens the caller gives global
            attention (HF Longformer's ``global_attention_mask``); ``None``: none beyond a mixer's own.
    """

    positions: Tensor
    mask: Tensor | None = None
    tokens: Tensor | None = None
    start_pos: int = 0
    slot: Tensor | None = None
    dropout: bool = False
    return_weights: bool = False
    global_tokens: Tensor | None = None


@dataclass
class Shared:
    """Objects built once per model and handed to every layer's mixer (e.g. the rotary table)."""

    rope: nn.Module | None = None
