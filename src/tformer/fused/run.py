"""Running a model's layers whole: which calls can (:func:`route`), and the calls (:func:`forward`, :func:`decode`).

A call takes the whole layers when the model's choice has a plan (:func:`tformer.fused.chosen`),
no hooks are set, and the call is one ``layers.cpp`` serves (:func:`route` checks all of it, and
nothing else does):

- :func:`forward`: ``T <= MAX_TOKENS`` new tokens per row after the ``state.length`` tokens every
  row holds without padding: an eager state (``generate``'s prefill and steps, ``extend``), a row
  view of the server's static pool with ``length`` set, or a pool writer (``state.writer(rows,
  start)``: its layers write rows of the pool's caches). Token ``t`` of a row is written and rotated
  at ``state.length + t`` and attends causally to the held tokens and the new ones up to itself.
- :func:`decode`: the static one-token step (the server's pool): row ``b`` writes at
  ``state.index[b]``, is rotated at ``positions[b]`` and attends over the keys ``state.valid``
  marks real up to that index. On an eager state it is :func:`forward` with one token.

The caches are read as the state holds them (float32, bfloat16 or float16, ``(rows, nkv, L, hs)``,
views allowed); what the kernel reads of a state is found once per state and batch (:func:`_layout`).
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

from tformer.fused.plan import FLOAT_FMT, Plan, chosen
from tformer.mixers.kv_cache import KVCache, RowWriter
from tformer.nn.softcap import softcap

Tensor = torch.Tensor
# new tokens per row above which a call goes to the module path, whose attention kernel wins on long
# prompts (the measurement: docs/inference.md, "Several new tokens per row")
MAX_TOKENS = 256
# rows (tokens x batch rows) above which a call on float weights goes to the module path: a layer's
# float product reads each weight row once per token, torch's GEMM far less often
MAX_FLOAT_ROWS = 8
# state -> (its list of layers, batch rows, what _layout found): beside the state, as the choices are
_LAYOUTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class Route(NamedTuple):
    """A call the whole layers take: the model's plan and the state's caches as the kernel reads them."""
    plan: Plan
    caches: list            # per layer (k, v), each (rows, nkv, L, hs)
    slots: Tensor           # (B,) the cache row of each of the call's rows
    writer: bool            # the layers are a pool writer's (rows of a larger cache)


def route(model, state, B: int, T: int, *, step: bool = False, masked: bool = False) -> Route | None:
    """The :class:`Route` of a call of ``T`` new tokens on each of ``state``'s ``B`` rows, or ``None``:
    the module path takes it. ``step``: the call is :func:`~tformer.generation.step.decode_step`'s
    (on a static state, the static step); ``masked``: it came with an attention mask or positions,
    which only the static step reads."""
    if state is None or not state.layers or getattr(model, "hooks", None) is not None:
        return None                          # hooks are set per call (interp): never part of the choice
    plan = chosen(model).plan
    if plan is None or T > MAX_TOKENS or (plan.floats and B * T > MAX_FLOAT_ROWS):
        return None
    layout = _layout(state, B)
    if layout is None:
        return None
    caches, slots, writer = layout
    if step and state.static:                # the pool's step: per-row index, position and real keys
        if writer or int(state.index.max()) >= caches[0][0].shape[2]:
            return None                      # the module path says what is wrong
        return Route(plan, caches, slots, writer)
    if masked or state.length + T > state.max_len or (state.length and state.padded):
        return None                          # masks, held padding or an overflow: the module path's
    return Route(plan, caches, slots, writer)


def _float_cache(s) -> bool:
    return s.k.dtype in FLOAT_FMT and s.k.stride(3) == 1 and s.k.stride() == s.v.stride() and s.v.dtype == s.k.dtype


def _layout(state, B: int) -> tuple[list, Tensor, bool] | None:
    """What the kernel reads for ``state``'s ``B`` rows: the caches ``(k, v)`` per layer, the cache row
    of each row, and whether the layers are a pool writer's (``state.writer``: rows of a larger cache,
    which only :func:`forward` serves); ``None`` where the kernel cannot read the caches. Asked once
    per state and batch, not per token (a KVCache keeps its tensors for its life, and a new list of
    layers asks again)."""
    known = _LAYOUTS.get(state)
    if known is not None and known[0] is state.layers and known[1] == B:
        return known[2]
    layers = state.layers
    if all(isinstance(s, KVCache) and s.k.shape[0] == B and _float_cache(s) for s in layers):
        layout = [(s.k, s.v) for s in layers], torch.arange(B), False
    elif all(type(s) is RowWriter and isinstance(s.cache, KVCache) and _float_cache(s.cache)
             and s.slots is layers[0].slots for s in layers):
        layout = [(s.cache.k, s.cache.v) for s in layers], layers[0].slots.long(), True
    else:
        layout = None
    _LAYOUTS[state] = (layers, B, layout)
    return layout


def run_layers(p: Plan, x: Tensor, caches: list[tuple[Tensor, Tensor]], write: Tensor, at: Tensor,
               valid: Tensor | None, rows: Tensor | None) -> None:
    """Every layer on ``x (N, C)`` float32, in place, in one call of ``tformer_fused::layers``: token
    ``i`` of cache row ``rows[i]`` (``i`` without ``rows``) writes its key and value at ``write[i]``,
    is rotated at ``at[i]`` and reads the keys ``j <= write[i]`` of its row (those ``valid`` marks real)."""
    cos, sin = p.rotary() if p.rope is not None else (None, None)
    local_cos, local_sin = p.rotary(p.local_rope) if p.local_rope is not None else (None, None)
    norms, mats, biases, fmts = p.flat
    torch.ops.tformer_fused.layers(x, norms, p.eps, mats, biases, fmts, p.dims, [k for k, _ in caches],
                                   [v for _, v in caches], write, at, valid, rows, cos, sin, p.path_id, p.windows,
                                   p.scale, p.softcap, local_cos, local_sin)


def _ensure(p: Plan, length: int, context) -> None:
    """The rotary tables cover ``length`` positions (a LongRoPE's set: the state's ``context``); the
    windowed layers' own table too, as the module path grows both."""
    if p.rope is not None:
        p.rope.ensure(length, context)
    if p.local_rope is not None:
        p.local_rope.ensure(length, context)


def _embed(model, p: Plan, ids: Tensor, at: Tensor) -> Tensor:
    """``ids (N,)`` at positions ``at (N,)`` -> the float32 residual stream ``(N, C)``: the token
    embedding (times sqrt(d) with ``embedding_scale``, in the model's dtype as the module path takes it),
    plus the learned position's where the model has a table."""
    x = model.tok_emb(ids)
    if model.embed_scale != 1.0:
        x = x * model.embed_scale
    x = x.float()
    if p.pos_emb is not None:
        x = x + p.pos_emb(at).float()
    return x.contiguous()


def _head(model, p: Plan, x: Tensor) -> Tensor:
    """Final norm and LM head as modules, in the model's dtype (the layers' stream is float32), then the
    logits' soft-cap where the model has one (Gemma 2; the module path's :func:`~tformer.nn.softcap.softcap`)."""
    logits = model.lm_head(model.final_norm(x.to(model.tok_emb.weight.dtype)))
    return softcap(logits, model.config.logit_softcap)                  # unchanged without a cap


def forward(model, ids: Tensor, state, r: Route, *, last_index: Tensor | None = None,
            last_only: bool = False) -> Tensor:
    """``ids (B, T)`` new tokens per row through the whole layers, on the route :func:`route` gave:
    logits ``(B, T, vocab)``, or ``(B, 1, vocab)`` at ``last_index[b]`` (a right-padded prompt) or at
    the last token (``last_only``). Writes the caches at ``state.length + t`` and advances the state
    as the module path does (every key is written before any token attends, so the new tokens of a
    row see each other causally through the cache)."""
    p, (B, T) = r.plan, ids.shape
    pos = state.length
    _ensure(p, max(pos + T, r.caches[0][0].shape[2]), state.context)          # a LongRoPE's set: the state's
    where = torch.arange(pos, pos + T)
    where = where.repeat(B) if B > 1 else where                                     # (B T,) index = position
    x = _embed(model, p, ids.reshape(B * T), where)                                # (B T, C)
    run_layers(p, x, r.caches, where, where, None, r.slots.repeat_interleave(T).contiguous() if T > 1 else r.slots)
    state.valid[:, pos:pos + T] = True
    state.advance(pos + T)
    x = x.view(B, T, -1)
    if last_index is not None:
        x = x[torch.arange(B), last_index][:, None]                                # (B, 1, C)
    elif last_only:
        x = x[:, -1:]
    return _head(model, p, x)                                                      # (B, T|1, vocab)


def decode(model, tokens: Tensor, state, r: Route, positions: Tensor | None = None,
           attention_mask: Tensor | None = None) -> Tensor:
    """One token per row, ``tokens (B, 1)`` -> logits ``(B, vocab)``, on the route :func:`route` gave
    with ``step=True``. Eager state: :func:`forward` with one token. Static state (the server's pool):
    row ``b`` writes at ``state.index[b]``, is rotated at ``positions[b]`` (default: its count of real
    tokens held) and attends over the keys ``state.valid`` marks real up to that index (its own token
    real unless ``attention_mask`` says padding); ``state.index`` then advances by one."""
    if not state.static:
        return forward(model, tokens, state, r, last_only=True)[:, -1]
    p, B = r.plan, tokens.shape[0]
    index = state.index                                                             # (B,)
    at = positions[:, -1] if positions is not None else state.valid.sum(-1)        # (B,) before this token
    real = True
    if attention_mask is not None:
        real = attention_mask[:, -1].bool()                                         # (B,)
        state.padded = True                  # as the module path marks it: a mask may hold padding
    state.valid[torch.arange(B), index] = real
    _ensure(p, max(r.caches[0][0].shape[2], state.max_len), state.context)
    at = at.long().contiguous()
    x = _embed(model, p, tokens.reshape(B), at)                                     # (B, C)
    run_layers(p, x, r.caches, index.contiguous(), at, state.valid, None)
    state.index.add_(1)
    return _head(model, p, x[:, None])[:, -1]                                       # (B, vocab)
