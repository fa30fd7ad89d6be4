"""Hook points: read or replace any named activation of a forward pass.

A model built on :class:`~tformer.models.stack.TransformerStack` visits its hook points only while
its ``hooks`` attribute holds a function ``hooks(name, tensor) -> tensor`` (the stack hands it to
every block and mixer in the :class:`~tformer.mixers.base.Step`); with ``hooks = None``, the default,
the forward is the ordinary one. This module sets that function for the length of one call.

The names and shapes follow TransformerLens (so results read alike and can be checked against it):

    hook_embed, hook_pos_embed                          (B, T, C)   token / learned-position embedding
    blocks.{i}.hook_resid_pre|mid|post                  (B, T, C)   the residual stream around block i
    blocks.{i}.attn.hook_q, hook_rot_q                  (B, T, nh, hs)   queries before / after RoPE
    blocks.{i}.attn.hook_k|v, hook_rot_k                (B, T, nkv, hs)
    blocks.{i}.attn.hook_attn_scores, hook_pattern      (B, nh, T, m)    masked scores, softmax
    blocks.{i}.attn.hook_z                              (B, T, nh, hs)   each head's output
    blocks.{i}.hook_attn_out, hook_mlp_out              (B, T, C)   what each sub-layer adds
    blocks.{i}.mlp.hook_pre, hook_pre_linear, hook_post (B, T, d_ff)
    ln_final.hook_out                                   (B, T, C)   the final norm's output (weighted)
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterable, Iterator

import torch
import torch.nn as nn

from tformer.errors import InputError
from tformer.interp.cache import ActivationCache

Tensor = torch.Tensor
HookFn = Callable[[Tensor, str], "Tensor | None"]


def hook_names(model: nn.Module) -> list[str]:
    """Every hook point ``model`` visits, in forward order (its softmax-attention and MLP layers
    name their insides; any other mixer shows only the block-level points)."""
    c = model.config
    names = ["hook_embed"] + (["hook_pos_embed"] if model.pos_emb is not None else [])
    for i, block in enumerate(model.blocks):
        p = f"blocks.{i}."
        names.append(p + "hook_resid_pre")
        if hasattr(block.attn, "forward_hooked"):
            names += [p + "attn.hook_q", p + "attn.hook_k", p + "attn.hook_v"]
            if block.attn.rope is not None:
                names += [p + "attn.hook_rot_q", p + "attn.hook_rot_k"]
            names += [p + "attn.hook_attn_scores", p + "attn.hook_pattern", p + "attn.hook_z"]
        names += [p + "hook_attn_out", p + "hook_resid_mid"]
        if block.ffn is not None and hasattr(block.ffn, "hooked"):
            names += [p + "mlp.hook_pre"] + ([p + "mlp.hook_pre_linear"] if c.ffn in ("swiglu", "geglu") else []) \
                + [p + "mlp.hook_post"]
        if block.ffn is not None:
            names.append(p + "hook_mlp_out")
        names.append(p + "hook_resid_post")
    return names + ["ln_final.hook_out"]


class HookSet:
    """The function a model calls at each hook point: runs the functions registered for that name
    in order, each ``fn(tensor, name)`` returning a replacement or ``None`` (keep the tensor).

    A replacement must be a tensor of the shape, dtype and device of the one it replaces: anything else
    (a list, a float64 tensor in a float32 model, ``t[:1]`` for a batch of two, a ``(C,)`` vector that
    would be broadcast to every position) is refused naming the hook point and both shapes, rather than
    failing deep inside torch or silently giving logits of another shape."""

    def __init__(self, fwd_hooks: Iterable[tuple[str | Callable[[str], bool], HookFn]], known: list[str]):
        self.by_name: dict[str, list[HookFn]] = {}
        if isinstance(fwd_hooks, dict) or isinstance(fwd_hooks, (str, bytes)):
            raise InputError(f"fwd_hooks is a {type(fwd_hooks).__name__}; pass a list of (name, fn) pairs "
                             f"(from a dict: list(hooks.items())).")
        for pair in fwd_hooks:
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and callable(pair[1])
                    and (isinstance(pair[0], str) or callable(pair[0]))):
                raise InputError(f"each of fwd_hooks must be a pair (name, fn): a hook-point name (or a predicate "
                                 f"on names) and a function fn(tensor, name); got {pair!r:.80}.")
            name, fn = pair
            matched = [n for n in known if name(n)] if callable(name) else [name]
            if not callable(name) and name not in known:
                raise InputError(f"no hook point named {name!r}; tformer.interp.hook_names(model) lists the "
                                 f"{len(known)} this model has (e.g. {known[1]!r}).")
            for n in matched:
                self.by_name.setdefault(n, []).append(fn)

    def __call__(self, name: str, t: Tensor) -> Tensor:
        for fn in self.by_name.get(name, ()):
            out = fn(t, name)
            if out is not None:
                check_replacement(name, fn, t, out)
                t = out
        return t


def check_replacement(name: str, fn: HookFn, t: Tensor, out) -> None:
    """Refuse a hook's return value that cannot stand for ``t`` at hook point ``name`` (see :class:`HookSet`)."""
    who = f"the hook {getattr(fn, '__name__', type(fn).__name__)!r} on {name!r}"
    want = f"a tensor of shape {tuple(t.shape)}, {str(t.dtype).removeprefix('torch.')} on {t.device}"
    if not isinstance(out, Tensor):
        raise InputError(f"{who} returned a {type(out).__name__}; it must return {want} (or None to keep it).")
    if out.shape != t.shape:
        raise InputError(f"{who} returned shape {tuple(out.shape)}; it must return {want} (or None): the batch, "
                         f"positions and channels of what it was given, e.g. t.clone() edited in place.")
    if out.dtype != t.dtype or out.device != t.device:
        raise InputError(f"{who} returned {str(out.dtype).removeprefix('torch.')} on {out.device}; it must return "
                         f"{want} (or None): use .to(t.dtype) / .to(t.device).")


def check_ids(model: nn.Module, ids) -> None:
    """``ids`` must be token ids ``(B, T)`` the model can embed: an integer tensor of two dimensions, each
    id in ``[0, vocab_size)``; anything else is one sentence here rather than an error deep inside torch."""
    if not isinstance(ids, Tensor):
        raise InputError(f"ids must be a tensor of token ids (B, T); got a {type(ids).__name__}.")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise InputError(f"ids must be integer token ids (B, T); got {str(ids.dtype).removeprefix('torch.')}.")
    if ids.dim() != 2:
        hint = f" (one prompt: ids[None], shape (1, {ids.shape[0]}))" if ids.dim() == 1 else ""
        raise InputError(f"ids must have two dimensions (B, T); got shape {tuple(ids.shape)}{hint}.")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= model.config.vocab_size):
        raise InputError(f"ids hold token {int(ids.min()) if int(ids.min()) < 0 else int(ids.max())}, outside this "
                         f"model's vocabulary [0, {model.config.vocab_size}).")


@contextmanager
def hooks_set(model: nn.Module, fwd_hooks) -> Iterator[None]:
    """Inside the block, ``model`` visits its hook points and calls ``fwd_hooks``; after it (also on
    an error) the model is the plain one again."""
    if not hasattr(model, "hooks") or not hasattr(model, "blocks"):
        raise InputError(f"{type(model).__name__} has no hook points; hooks need a tformer DecoderLM (or another "
                         f"TransformerStack model).")
    if model.hooks is not None:
        raise InputError("hooks are already set on this model (a hooked run inside another); run them one at a time.")
    model.hooks = HookSet(fwd_hooks, hook_names(model))
    try:
        yield
    finally:
        model.hooks = None


def run_with_hooks(model: nn.Module, ids: Tensor, fwd_hooks=(), **forward_kwargs) -> Tensor:
    """Logits ``(B, T, vocab)`` of ``model(ids)`` with ``fwd_hooks`` — pairs ``(name, fn)``, ``name`` a
    hook-point name or a predicate on names, ``fn(tensor, name)`` returning a replacement or ``None``."""
    with hooks_set(model, fwd_hooks):
        check_ids(model, ids)
        return model(ids, **forward_kwargs)[0]


def run_with_cache(model: nn.Module, ids: Tensor, names: Iterable[str] | Callable[[str], bool] | None = None,
                   fwd_hooks=(), **forward_kwargs) -> tuple[Tensor, ActivationCache]:
    """``(logits, cache)``: the logits of ``model(ids)`` and the activations at ``names`` (every hook
    point when ``None``; a predicate selects), as the forward saw them (after any ``fwd_hooks``,
    which run first). Tensors are kept with their graph if grad is on (attribution by gradients)."""
    store: dict[str, Tensor] = {}

    def save(t: Tensor, name: str) -> None:
        store[name] = t

    known = hook_names(model)
    chosen = known if names is None else [n for n in known if names(n)] if callable(names) else list(names)
    if isinstance(fwd_hooks, (dict, str, bytes)):
        HookSet(fwd_hooks, known)                 # refused there, with the same words as run_with_hooks
    with hooks_set(model, list(fwd_hooks) + [(n, save) for n in chosen]):
        check_ids(model, ids)
        logits = model(ids, **forward_kwargs)[0]
    return logits, ActivationCache(store, model)
