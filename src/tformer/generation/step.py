"""The public prefill / decode-step pair: the two model calls every generator makes.

    state  = model.new_state(B, max_len)             # or static=True: fixed shapes for torch.compile
    logits = prefill(model, ids, state)               # (B, T) prompt -> (B, vocab), state holds T tokens
    logits = decode_step(model, tokens, state)        # (B, 1) newest tokens -> (B, vocab), one more held
    logits = extend(model, tokens, state)             # (B, T) tokens -> (B, T, vocab): speculative checks

(gpt-fast's ``prefill()`` / ``decode_one_token()``.) :func:`tformer.generation.generate.generate`
(eager, static and compiled), beam search over an encoder-decoder, the server's pool and the
playground all call these two and nothing below them, so how a step runs is decided in one place:

- the *state class* decides eager against static decoding (``model.new_state(..., static=True)``
  builds every mixer's static state; a one-token step on it writes each row at its own tensor
  index, see :mod:`tformer.mixers.base`), not a flag in every call;
- ``compiled=True`` runs the static step through ``torch.compile`` (one graph per model and batch
  shape, reused by every step of every generation);
- the caller picks the mode: these functions run under whatever grad / inference mode is active
  (generation wraps them in ``torch.inference_mode``; the playground's attribution needs gradients);
- each model call runs one of two routes, asked once per call (:func:`tformer.fused.route`): whole
  layers in one C++ call (:mod:`tformer.fused`, where the model's choice has a plan and the call is
  one the kernel serves) or the module path (``model(...)``, everything else).
"""

from __future__ import annotations

import torch

import tformer.fused as fused
from tformer.errors import InputError

Tensor = torch.Tensor


def prefill(model, ids: Tensor, state=None, *, attention_mask: Tensor | None = None,
            positions: Tensor | None = None, last_index: Tensor | None = None,
            chunk: int | None = None) -> Tensor:
    """Run a prompt through ``model``, writing it into ``state``; return the next-token logits.

    Args:
        model: a :class:`~tformer.models.decoder.DecoderLM`.
        ids: ``(B, T)`` prompt ids (left-padded under ``attention_mask``, or right-padded with
            ``last_index``).
        state: an :class:`~tformer.models.state.InferenceState` (it holds the ``T`` tokens after
            what it held), or ``None`` (one uncached forward).
        attention_mask: ``(B, T)`` 1 for tokens, 0 for padding, over ``ids`` (the earlier tokens,
            if the state holds some, are read from ``state.valid``).
        positions: ``(T,)`` or ``(B, T)`` absolute positions; default: counted over real tokens.
        last_index: ``(B,)`` take row ``b``'s logits at position ``last_index[b]`` instead of the
            last one (right-padded prompts of different lengths).
        chunk: run the prompt ``chunk`` tokens at a time (needs a state; bounds the memory of
            the attention scores).
    Returns:
        ``(B, vocab)`` logits of the token after each row's last (or ``last_index``) token.
    Raises:
        InputError: for ids of the wrong shape or outside the vocabulary, a prompt past the
            state's ``max_len`` or the position table, ``chunk`` without a state or with
            ``last_index``.
    """
    if ids.dim() != 2 or ids.shape[1] == 0:
        raise InputError(f"ids must be a non-empty (batch, seq_len) tensor, got shape {tuple(ids.shape)}.")
    T = ids.shape[1]
    if chunk is not None and (chunk < 1 or state is None or last_index is not None):
        raise InputError(f"chunk={chunk} needs to be >= 1, a state to carry the chunks and no last_index.")
    bounds = [(s, min(s + chunk, T)) for s in range(0, T, chunk)] if chunk else [(0, T)]
    for s, e in bounds:
        mask = attention_mask[:, s:e] if attention_mask is not None else None
        pos = positions[..., s:e] if positions is not None else None
        route = fused.route(model, state, ids.shape[0], e - s, masked=mask is not None or pos is not None)
        if route is not None:
            logits = fused.forward(model, ids[:, s:e], state, route, last_index=last_index, last_only=True)
        else:
            logits, _ = model(ids[:, s:e], attention_mask=mask, positions=pos, state=state,
                              last_only=last_index is None, last_index=last_index)
        _count_static_token(state, e - s)
    return logits[:, -1]                                                        # (B, vocab)


def decode_step(model, tokens: Tensor, state, *, attention_mask: Tensor | None = None,
                positions: Tensor | None = None, compiled: bool = False) -> Tensor:
    """Feed each row's newest token and return the logits of the one after it.

    Args:
        model: a DecoderLM, or an encoder-decoder (anything with ``decode_step(tokens, state)``:
            its state holds the encoded source, see :mod:`tformer.generation.beam`).
        tokens: ``(B, 1)`` ids, one per row.
        state: the request's state after :func:`prefill` (or the encoder-decoder's ``new_state``).
            On a static state row ``b`` writes at ``state.index[b]`` and reads the keys
            ``state.valid`` marks real up to it.
        attention_mask: ``(B, 1)`` 1 if the token is real, 0 if padding. On an eager state that
            holds left padding it must be given (then the held padding is read from
            ``state.valid``); ``None`` there means no row holds any padding, which spares the
            mask. A static state always reads ``state.valid`` (``None``: the tokens are real).
        positions: ``(B, 1)`` absolute positions (default: each row's count of real tokens held).
        compiled: run the step through ``torch.compile`` (needs a static state).
    Returns:
        ``(B, vocab)`` next-token logits.
    Raises:
        InputError: for tokens that are not ``(B, 1)``, a state that is full, or ``compiled``
            without a static state.
    """
    if tokens.dim() != 2 or tokens.shape[1] != 1:
        raise InputError(f"decode_step takes one token per row, (batch, 1); got shape {tuple(tokens.shape)}.")
    if hasattr(model, "decode_step"):                       # encoder-decoders: the state holds the source
        return model.decode_step(tokens, state)[:, -1]                         # (B, vocab)
    if compiled and not getattr(state, "static", False):
        raise InputError("compiled=True needs a static state: make it with model.new_state(B, max_len, static=True).")
    route = None if compiled else fused.route(model, state, tokens.shape[0], 1, step=True,
                                              masked=positions is not None or attention_mask is not None)
    if route is not None:
        logits = fused.decode(model, tokens, state, route, positions, attention_mask)
    else:
        logits = (compiled_decode() if compiled else decode_logits)(model, tokens, state, positions, attention_mask)
    _count_static_token(state, 1)
    return logits


def extend(model, ids: Tensor, state) -> Tensor:
    """Feed ``T`` tokens per row after what ``state`` holds and return the logits after EVERY one of
    them: ``(B, T)`` -> ``(B, T, vocab)``, row ``b``'s ``[:, t]`` predicting the token after
    ``ids[b, t]``. The verification forward of speculative decoding (``k`` draft tokens and the
    token before them checked in one call); the state then holds ``T`` more tokens, and the caller
    forgets the rejected ones with ``state.truncate``. Works on an eager state, or on a static
    state's row view with ``length`` set to what it holds (``T >= 2`` there: one token is the static
    step). Every row must hold the same number of real tokens without padding (a batch-1 view).

    Raises:
        InputError: for ids that are not ``(B, T)`` or a state that cannot take ``T`` more tokens.
    """
    if ids.dim() != 2 or ids.shape[1] == 0:
        raise InputError(f"ids must be a non-empty (batch, seq_len) tensor, got shape {tuple(ids.shape)}.")
    if getattr(state, "static", False) and ids.shape[1] == 1:
        raise InputError("extend on a static state needs at least 2 tokens (one token is decode_step).")
    route = fused.route(model, state, ids.shape[0], ids.shape[1])
    if route is not None:
        return fused.forward(model, ids, state, route)                          # (B, T, vocab)
    logits, _ = model(ids, state=state)
    return logits                                                               # (B, T, vocab)


def decode_logits(model, tokens: Tensor, state, positions: Tensor | None = None,
                  attention_mask: Tensor | None = None) -> Tensor:
    """The model call of :func:`decode_step` alone, ``(B, 1)`` -> ``(B, vocab)``: on a static state
    it reads and writes only tensors, which is what ``torch.compile`` captures."""
    logits, _ = model(tokens, attention_mask=attention_mask, positions=positions, state=state, last_only=True)
    return logits[:, -1]


_COMPILED: dict[str, object] = {}


def compiled_decode():
    """``torch.compile`` of :func:`decode_logits`, made once per process (dynamo keeps a graph per
    model and shape)."""
    if "decode" not in _COMPILED:
        _COMPILED["decode"] = torch.compile(decode_logits, dynamic=False)
    return _COMPILED["decode"]


def _count_static_token(state, T: int) -> None:
    """A static state's one-token step advances ``state.index`` on the tensor side only; keep its
    Python ``length`` in step here, outside anything compiled."""
    if state is not None and getattr(state, "static", False) and T == 1:
        state.length += 1
