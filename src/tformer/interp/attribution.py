"""Direct logit attribution: how much each head, MLP and embedding writes the logit of a token.

A pre-norm model's final residual stream is a sum of pieces,

    resid = embed (+ pos_embed) + Σ_layers ( Σ_heads z_h W_O,hᵀ + b_O + mlp_out ),

and its logit for token t is ``W_U[t] · norm(resid)``. With the norm's divisor σ (a property of the
whole stream) held fixed, ``norm`` is linear: ``norm(resid) = Σ_pieces centre(piece)/σ · w + b``.
So each piece's *direct* contribution is ``centre(piece)/σ · w · W_U[t]``, and the contributions
plus the constant ``b · W_U[t]`` sum to the logit exactly. "Direct" means through the residual
stream straight to the unembedding: what a head does by changing later layers is not counted
(activation patching measures that).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tformer.interp.cache import ActivationCache, centre_and_scale

Tensor = torch.Tensor


def head_outputs(model: nn.Module, cache: ActivationCache, layer: int) -> Tensor:
    """``(B, T, nh, C)``: what each head of ``layer`` writes into the residual stream, ``z_h W_O,hᵀ``
    (``out_proj``'s bias is not any head's; :func:`decompose_resid` lists it on its own)."""
    attn = model.blocks[layer].attn
    z = cache["z", layer]                                                       # (B, T, nh, hs)
    w = attn.out_proj.weight.view(-1, attn.n_heads, attn.head_dim)             # (C, nh, hs)
    return torch.einsum("bthd,chd->bthc", z, w)


def decompose_resid(model: nn.Module, cache: ActivationCache) -> tuple[list[str], Tensor]:
    """The final residual stream as labelled pieces ``(N, B, T, C)`` that sum to it: ``embed``,
    ``pos_embed``, then per layer ``L{i}H{h}`` for each head, ``L{i} attn bias`` and ``L{i} mlp``."""
    labels, parts = ["embed"], [cache["hook_embed"]]
    if "hook_pos_embed" in cache:
        labels.append("pos_embed")
        parts.append(cache["hook_pos_embed"])
    for i, block in enumerate(model.blocks):
        heads = head_outputs(model, cache, i)
        for h in range(heads.shape[2]):
            labels.append(f"L{i}H{h}")
            parts.append(heads[:, :, h])
        if block.attn.out_proj.bias is not None:
            labels.append(f"L{i} attn bias")
            parts.append(block.attn.out_proj.bias.expand_as(heads[:, :, 0]))
        if block.ffn is not None:
            labels.append(f"L{i} mlp")
            parts.append(cache["mlp_out", i])
    return labels, torch.stack(parts)


def logit_directions(model: nn.Module, tokens: Tensor, against: Tensor | None = None) -> Tensor:
    """``(B, C)``: the unembedding rows ``W_U[tokens]`` (less ``W_U[against]``: a logit difference)."""
    w = model.lm_head.weight
    return w[tokens] - (w[against] if against is not None else 0)


def direct_logit_attribution(model: nn.Module, cache: ActivationCache, tokens: Tensor,
                             against: Tensor | None = None, pos: int = -1) -> tuple[list[str], Tensor, Tensor]:
    """``(labels, contributions (N, B), constant (B,))``: each piece's direct contribution to the
    logit of ``tokens (B,)`` (minus that of ``against``) at position ``pos``; contributions plus the
    constant (the final norm's bias through the unembedding) equal the logit (difference)."""
    labels, parts = decompose_resid(model, cache)
    scale = cache.final_scale()[:, pos]                                         # (B, 1)
    normed = centre_and_scale(model.final_norm, parts[:, :, pos], scale)        # (N, B, C)
    direction = logit_directions(model, tokens, against).float()                # (B, C)
    contributions = (normed * direction).sum(-1)                                # (N, B)
    bias = getattr(model.final_norm, "bias", None)
    constant = direction @ bias.float() if bias is not None else torch.zeros(direction.shape[0])
    return labels, contributions, constant


def per_layer(labels: list[str], contributions: Tensor) -> tuple[list[str], Tensor]:
    """Sum :func:`direct_logit_attribution`'s pieces per layer and sub-layer: ``embed`` (with
    positions), ``L{i} attn`` (heads and bias), ``L{i} mlp``: ``(M, B)``."""
    groups: dict[str, Tensor] = {}
    for label, value in zip(labels, contributions):
        key = "embed" if label in ("embed", "pos_embed") else label.split(" ")[0].split("H")[0] + \
            (" mlp" if label.endswith("mlp") else " attn")
        groups[key] = groups.get(key, 0) + value
    return list(groups), torch.stack(list(groups.values()))
