"""The activations of one forward pass, by hook-point name, and the residual stream read from them."""

from __future__ import annotations

from typing import Iterator

import torch
import torch.nn as nn

from tformer.errors import InputError
from tformer.nn.norms import RMSNorm

Tensor = torch.Tensor

# Short names TransformerLens users type: cache["resid_pre", 3], cache["pattern", 0].
SHORT = {"resid_pre": "blocks.{}.hook_resid_pre", "resid_mid": "blocks.{}.hook_resid_mid",
         "resid_post": "blocks.{}.hook_resid_post", "attn_out": "blocks.{}.hook_attn_out",
         "mlp_out": "blocks.{}.hook_mlp_out", "q": "blocks.{}.attn.hook_q", "k": "blocks.{}.attn.hook_k",
         "v": "blocks.{}.attn.hook_v", "z": "blocks.{}.attn.hook_z", "pattern": "blocks.{}.attn.hook_pattern",
         "attn_scores": "blocks.{}.attn.hook_attn_scores", "pre": "blocks.{}.mlp.hook_pre",
         "post": "blocks.{}.mlp.hook_post"}


class ActivationCache:
    """A read-only mapping ``hook name -> tensor`` from :func:`~tformer.interp.hooks.run_with_cache`,
    with the model it came from (its final norm and unembedding read the residual stream)."""

    def __init__(self, store: dict[str, Tensor], model: nn.Module):
        self.store, self.model = store, model

    def __getitem__(self, key: str | tuple[str, int]) -> Tensor:
        name = key
        if isinstance(key, tuple):
            if len(key) != 2:
                raise InputError(f"a cache key is a hook name or a pair (short name, layer), e.g. "
                                 f"cache['resid_pre', 3]; got {key!r}.")
            kind, layer = key
            if kind not in SHORT:
                raise InputError(f"unknown short name {kind!r}; use one of {', '.join(SHORT)} or a full hook name.")
            name = SHORT[kind].format(self.layer_index(layer))
        if name not in self.store:
            raise InputError(f"the cache holds no {name!r}; run run_with_cache with names=None (all) or "
                             f"include it in names.")
        return self.store[name]

    def layer_index(self, layer) -> int:
        """``layer`` as a block index: an integer in ``[0, L)``, or ``[-L, -1]`` counted from the last block as
        Python counts; anything else (``"1"``, ``L + 3``, which TransformerLens refuses too) is refused."""
        L = len(self.model.blocks)
        if isinstance(layer, bool) or not hasattr(layer, "__index__"):
            raise InputError(f"the layer in a cache key must be an integer, got {layer!r} "
                             f"({type(layer).__name__}); e.g. cache['resid_pre', 1].")
        i = layer.__index__()
        if not -L <= i < L:
            raise InputError(f"layer {i} is out of range: this model has {L} blocks (layers 0 to {L - 1}, or -{L} "
                             f"to -1 from the end).")
        return i % L

    def __contains__(self, name: str) -> bool:
        return name in self.store

    def __iter__(self) -> Iterator[str]:
        return iter(self.store)

    def __len__(self) -> int:
        return len(self.store)

    def keys(self):
        return self.store.keys()

    def items(self):
        return self.store.items()

    def accumulated_resid(self) -> Tensor:
        """The residual stream entering each block and leaving the last: ``(n_layers + 1, B, T, C)``
        (``resid_pre`` of blocks ``0 .. L-1``, then ``resid_post`` of block ``L-1``)."""
        L = len(self.model.blocks)
        return torch.stack([self["resid_pre", i] for i in range(L)] + [self["resid_post", L - 1]])

    def final_scale(self) -> Tensor:
        """``(B, T, 1)``: what the final norm divides the last residual stream by (LayerNorm: its
        standard deviation after centring; RMSNorm: its root mean square), eps included."""
        return norm_scale(self.model.final_norm, self["resid_post", len(self.model.blocks) - 1])


def norm_scale(norm: nn.Module, x: Tensor) -> Tensor:
    """``(…, 1)``: the divisor ``norm`` applies to ``x`` (LayerNorm: sqrt(var + eps) after centring,
    RMSNorm: sqrt(mean(x²) + eps)), computed in float32 as the norms do."""
    x = x.float()
    if isinstance(norm, nn.LayerNorm):
        return (x.var(-1, keepdim=True, unbiased=False) + norm.eps).sqrt()
    if hasattr(norm, "eps"):
        return (x.pow(2).mean(-1, keepdim=True) + norm.eps).sqrt()
    raise InputError(f"the final norm is {type(norm).__name__}; the lens and attribution need a LayerNorm or "
                     f"RMSNorm (a pre-norm model).")


def centre_and_scale(norm: nn.Module, x: Tensor, scale: Tensor) -> Tensor:
    """The linear part of ``norm`` with its divisor fixed at ``scale``: ``(x - mean x) / scale · w``
    (LayerNorm) or ``x / scale · w`` (RMSNorm; ``1 + w`` for Gemma's). Summed over the pieces of a residual stream
    it gives ``norm(stream)`` less the LayerNorm bias: the decomposition behind direct logit attribution."""
    x = x.float()
    if isinstance(norm, nn.LayerNorm):
        x = x - x.mean(-1, keepdim=True)
    if isinstance(norm, RMSNorm):
        w = norm.gain()                                      # 1 + w for Gemma's
    else:
        w = norm.weight.float() if getattr(norm, "weight", None) is not None else 1.0
    return x / scale * w
