"""Activation patching and head ablation: causal effects, measured by intervening on one activation.

Patching (Meng et al., 2022; Wang et al., 2022) runs the *corrupted* prompt while copying one
activation from the *clean* run; the metric of the patched logits says how much of the clean
behaviour that activation alone restores. The clean and corrupted prompts must have the same
length (their tokens align position by position).

Ablation removes a head's output instead: *zero* (``z_h = 0``) or *mean* (``z_h`` replaced by its
mean over a reference batch and its positions), and reports the metric without it.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from tformer.errors import InputError
from tformer.interp.hooks import run_with_cache, run_with_hooks

Tensor = torch.Tensor
Metric = Callable[[Tensor], Tensor]


def _check_pair(clean: Tensor, corrupted: Tensor) -> None:
    if clean.shape != corrupted.shape:
        raise InputError(f"clean {tuple(clean.shape)} and corrupted {tuple(corrupted.shape)} prompts must have the "
                         f"same shape: patching copies activations position by position.")


def metric_value(metric: Metric, logits: Tensor, where: str) -> Tensor:
    """``metric(logits)`` as one number: a 0-d tensor or a Python number; a ``(B,)`` tensor (a metric per prompt)
    or anything else is refused naming what it returned and the run (``where``) it was measuring."""
    value = metric(logits)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.tensor(float(value))
    if isinstance(value, Tensor) and value.numel() == 1 and value.dim() == 0:
        return value
    shape = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, Tensor) else f"a {type(value).__name__}"
    raise InputError(f"the metric returned {shape} for {where}; it must return one number per run (a 0-d tensor): "
                     f"e.g. reduce over the batch with .mean().")


def check_heads(model: nn.Module, heads: dict[int, list[int]]) -> None:
    """``{layer: [head, ...]}`` must name layers in ``[0, n_layers)`` and heads in ``[0, n_heads)``; a negative
    head is refused rather than counted from the end (``-1`` would ablate the last head)."""
    if not isinstance(heads, dict):
        raise InputError(f"heads must be a dict {{layer: [head, ...]}}, e.g. {{0: [1, 3]}}; got a "
                         f"{type(heads).__name__}.")
    L, nh = len(model.blocks), model.config.n_heads
    for layer, hs in heads.items():
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < L:
            raise InputError(f"heads names layer {layer!r}; this model's layers are 0 to {L - 1}.")
        if isinstance(hs, int) or not all(isinstance(h, int) and not isinstance(h, bool) for h in hs):
            raise InputError(f"heads[{layer}] must be a list of head indices, e.g. [0, 2]; got {hs!r}.")
        bad = [h for h in hs if not 0 <= h < nh]
        if bad:
            raise InputError(f"heads[{layer}] names head(s) {bad}; layer {layer} has {nh} heads, 0 to {nh - 1} "
                             f"(negative indices are not counted from the end).")


@torch.no_grad()
def patch_residual(model: nn.Module, clean: Tensor, corrupted: Tensor, metric: Metric,
                   site: str = "resid_pre") -> Tensor:
    """``(n_layers, T)``: ``metric`` of the corrupted run with ``blocks.{l}.hook_{site}`` at
    position ``p`` taken from the clean run (``site``: resid_pre, resid_mid, resid_post, attn_out, mlp_out)."""
    _check_pair(clean, corrupted)
    L, T = len(model.blocks), clean.shape[1]
    names = [f"blocks.{l}.hook_{site}" for l in range(L)]
    _, cache = run_with_cache(model, clean, names=names)
    out = torch.empty(L, T)
    for l, name in enumerate(names):
        for p in range(T):
            def put(t: Tensor, _name: str, p=p, src=cache[name]) -> Tensor:
                t = t.clone()
                t[:, p] = src[:, p]
                return t
            out[l, p] = metric_value(metric, run_with_hooks(model, corrupted, [(name, put)]),
                                     f"{name} patched at position {p}")
    return out


@torch.no_grad()
def patch_heads(model: nn.Module, clean: Tensor, corrupted: Tensor, metric: Metric, by_pos: bool = False) -> Tensor:
    """``(n_layers, n_heads)``: ``metric`` with head ``h`` of layer ``l``'s output ``z`` taken from the
    clean run at every position (``by_pos``: ``(n_layers, T, n_heads)``, one position at a time)."""
    _check_pair(clean, corrupted)
    L, nh, T = len(model.blocks), model.config.n_heads, clean.shape[1]
    names = [f"blocks.{l}.attn.hook_z" for l in range(L)]
    _, cache = run_with_cache(model, clean, names=names)
    positions = range(T) if by_pos else [slice(None)]
    out = torch.empty(L, len(positions), nh)
    for l, name in enumerate(names):
        for i, p in enumerate(positions):
            for h in range(nh):
                def put(t: Tensor, _name: str, p=p, h=h, src=cache[name]) -> Tensor:
                    t = t.clone()
                    t[:, p, h] = src[:, p, h]
                    return t
                out[l, i, h] = metric_value(metric, run_with_hooks(model, corrupted, [(name, put)]),
                                            f"head {h} of layer {l} patched")
    return out if by_pos else out[:, 0]


def ablation_hook(layer_heads: dict[int, list[int]], mode: str, means: dict[int, Tensor] | None = None):
    """``fwd_hooks`` removing the given heads (``{layer: [head, ...]}``): ``z_h`` set to zero or to
    ``means[layer][h]`` ``(hs,)``."""
    if mode not in ("zero", "mean"):
        raise InputError(f"ablation mode must be 'zero' or 'mean', got {mode!r}.")
    hooks = []
    for layer, heads in layer_heads.items():
        def ablate(t: Tensor, _name: str, layer=layer, heads=list(heads)) -> Tensor:
            bad = [h for h in heads if not 0 <= h < t.shape[2]]
            if bad:
                raise InputError(f"cannot ablate head(s) {bad} of layer {layer}: it has {t.shape[2]} heads, 0 to "
                                 f"{t.shape[2] - 1} (negative indices are not counted from the end).")
            t = t.clone()
            t[:, :, heads] = 0.0 if mode == "zero" else means[layer][heads].to(t.dtype)
            return t
        hooks.append((f"blocks.{layer}.attn.hook_z", ablate))
    return hooks


@torch.no_grad()
def head_means(model: nn.Module, reference: Tensor) -> dict[int, Tensor]:
    """``{layer: (n_heads, hs)}``: each head's ``z`` averaged over the reference batch and positions."""
    L = len(model.blocks)
    _, cache = run_with_cache(model, reference, names=[f"blocks.{l}.attn.hook_z" for l in range(L)])
    return {l: cache["z", l].mean(dim=(0, 1)) for l in range(L)}


@torch.no_grad()
def ablate_heads(model: nn.Module, ids: Tensor, heads: dict[int, list[int]], mode: str = "zero",
                 reference: Tensor | None = None) -> Tensor:
    """Logits ``(B, T, vocab)`` of ``model(ids)`` with ``heads`` (``{layer: [head, ...]}``) ablated;
    ``mode="mean"`` uses the heads' means over ``reference`` (default ``ids``)."""
    check_heads(model, heads)
    means = head_means(model, ids if reference is None else reference) if mode == "mean" else None
    return run_with_hooks(model, ids, ablation_hook(heads, mode, means))


@torch.no_grad()
def head_ablation_effects(model: nn.Module, ids: Tensor, metric: Metric, mode: str = "zero",
                          reference: Tensor | None = None) -> Tensor:
    """``(n_layers, n_heads)``: ``metric`` with each head ablated alone."""
    L, nh = len(model.blocks), model.config.n_heads
    means = head_means(model, ids if reference is None else reference) if mode == "mean" else None
    out = torch.empty(L, nh)
    for l in range(L):
        for h in range(nh):
            out[l, h] = metric_value(metric, run_with_hooks(model, ids, ablation_hook({l: [h]}, mode, means)),
                                     f"head {h} of layer {l} ablated")
    return out
