"""One C++ call per layer for a decode step of a block-quantised Llama-shaped model.

A decode step of SmolLM2-135M is 30 layers of ~50 small torch ops each (norms, RoPE, the cache
write, attention over the cache, SiLU, residual adds) around 5 products: at 576 wide the Python
and dispatch cost of those ops is about as large as reading the weights. :func:`decode` runs each
layer as one call of ``tformer_qgemv::decode_layer`` (qgemv.cpp, "one fused decode layer"):

    h = RMSNorm(x) g_attn;  [q|k|v] = h Wqkvᵀ;  RoPE(q, k) at pos;  K[pos], V[pos] <- k, v
    x += softmax(q Kᵀ / sqrt(hs)) V · Woᵀ                     (GQA: head h reads kv head h // (nh/nkv))
    h = RMSNorm(x) g_ffn;   x += (silu(h Wgᵀ) * (h Wuᵀ)) Wdᵀ

with the same tile kernels and the same activation quantisation as :class:`BlockLinear` (so the
products are the module path's to the bit; the norm, softmax and weighted sum differ only in float
summation order), then the final norm and the LM head as modules.

It applies when everything it does not implement is absent (:func:`plan` says why not, and then
the module path runs unchanged): a pre-norm RMSNorm + SwiGLU + RoPE (rotate-half) stack of
:class:`~tformer.mixers.attention.MultiHeadAttention` layers without biases, QK-norm, sliding
window, ALiBi, logit soft-cap or hooks, every product a :class:`BlockLinear` on a SIMD tile path,
float32; and a call it can serve: one token per row, an eager float32 :class:`KVCache` per layer
(contiguous), every row holding the same ``state.length`` tokens without padding, no explicit
positions or attention mask (what ``generate`` and the benchmark pass at batch 1).
``TFORMER_FUSED_DECODE=0`` turns it off (A/B runs, tests of the module path).
"""

from __future__ import annotations

import os

import torch

from tformer.quant import qgemv
from tformer.quant.block_linear import BlockLinear

Tensor = torch.Tensor
SWITCH = "TFORMER_FUSED_DECODE"


def _why_not(model) -> str | None:
    """``None`` if the fused layer implements ``model``'s decode step, else the first reason it does not."""
    from tformer.mixers.attention import MultiHeadAttention
    from tformer.nn.feed_forward import SwiGLU
    from tformer.nn.norms import RMSNorm

    c = getattr(model, "config", None)
    if c is None or not hasattr(model, "blocks") or not hasattr(model, "lm_head"):
        return "not a decoder LM"
    if c.norm != "rmsnorm" or c.norm_placement != "pre" or c.positions != "rope":
        return "needs pre-norm RMSNorm and RoPE"
    if c.logit_softcap or c.embedding_norm or c.embedding_scale or model.pos_emb is not None \
            or getattr(model, "type_emb", None) is not None:
        return "a soft-cap, an embedding norm or scale, or a position or token-type table"
    if model.training or model.hooks is not None or not isinstance(model.final_norm, RMSNorm):
        return "training, hooks or no final RMSNorm"
    path = qgemv.path()
    if path not in qgemv.TILE_ROWS:
        return f"kernel path {path} has no tiles"
    for b in model.blocks:
        a, f = b.attn, b.ffn
        if type(a) is not MultiHeadAttention or not isinstance(f, SwiGLU) or b.cross_attn is not None:
            return "a layer that is not self-attention + SwiGLU"
        if a.qk_norm or a.window is not None or a.alibi_slopes is not None or a.rope is None:
            return "QK-norm, a window or ALiBi"
        if not (isinstance(b.attn_norm, RMSNorm) and isinstance(b.ffn_norm, RMSNorm)):
            return "a norm that is not RMSNorm"
        if b.attn_norm.eps != b.ffn_norm.eps:
            return "norms with different eps"
        for lin in (a.qkv_proj, a.out_proj, f.gate, f.up, f.down):
            if not isinstance(lin, BlockLinear) or lin.bias is not None:
                return "a product that is not a bias-free BlockLinear"
    return None


class Plan:
    """What each layer's call reads, gathered once per model and kernel path (the tiles BlockLinear
    makes at its first call, made here if no call came yet)."""

    def __init__(self, model, path: str):
        self.path, self.path_id = path, qgemv.PATHS.index(path)
        c = model.config
        self.dims = [c.n_heads, c.n_kv_heads, c.head_dim, model.blocks[0].ffn.gate.out_features]
        self.eps = float(model.blocks[0].attn_norm.eps)
        self.layers = []
        for b in model.blocks:
            lins = (b.attn.qkv_proj, b.attn.out_proj, b.ffn.gate, b.ffn.up, b.ffn.down)
            tiles = [_tiles(lin, path) for lin in lins]
            fmts = [qgemv.FMT[lin.fmt] for lin in lins]
            self.layers.append((b.attn_norm.weight.detach().float().contiguous(), tiles,
                                b.ffn_norm.weight.detach().float().contiguous(), fmts))
        self.rope = model.blocks[0].attn.rope


def _tiles(lin: BlockLinear, path: str) -> Tensor:
    t = lin._tiled.get(path)
    if t is None:
        t = lin._tiled[path] = qgemv.tiles(lin.blocks, lin.fmt, path)
    return t


def plan(model) -> Plan | None:
    """The model's fused-decode plan for the current kernel path, or ``None`` where it does not apply
    (cached on the model; the reason is in ``model._fused_why``)."""
    path = qgemv.path()
    cached = getattr(model, "_fused_plan", None)
    key = (path, model.training, id(model.blocks[0].attn.qkv_proj) if hasattr(model, "blocks") else None)
    if cached is not None and cached[0] == key:
        return cached[1]
    why = _why_not(model) if qgemv.load() is not None else "the kernels are not built"
    p = Plan(model, path) if why is None else None
    object.__setattr__(model, "_fused_plan", (key, p))
    object.__setattr__(model, "_fused_why", why)
    return p


def applies(state, tokens: Tensor, positions, attention_mask) -> bool:
    """Whether the call is one :func:`decode` serves (see the module docstring)."""
    from tformer.mixers.kv_cache import KVCache, StaticKVCache

    if positions is not None or attention_mask is not None or state is None or getattr(state, "static", False):
        return False
    if tokens.dim() != 2 or tokens.shape[1] != 1 or state.length >= state.max_len or state.length == 0:
        return False
    for s in state.layers:
        if type(s) is not KVCache or isinstance(s, StaticKVCache) or s.k.dtype != torch.float32 \
                or not s.k.is_contiguous() or not s.v.is_contiguous() or s.k.shape[0] != tokens.shape[0]:
            return False
    # no padding held: every row's first ``length`` positions are real
    return bool(state.valid[:, :state.length].all())


def enabled() -> bool:
    return os.environ.get(SWITCH, "1") != "0"


def decode(model, tokens: Tensor, state) -> Tensor | None:
    """The fused decode step: ``tokens (B, 1)`` -> logits ``(B, vocab)``, writing every layer's cache at
    ``state.length`` and advancing the state; ``None`` (nothing touched) when it does not apply."""
    if not enabled():
        return None
    p = plan(model)
    if p is None or not applies(state, tokens, None, None):
        return None
    pos = state.length
    p.rope.ensure(pos + 1)
    cos, sin = p.rope.cos[pos].contiguous(), p.rope.sin[pos].contiguous()           # (hs,)
    x = model.tok_emb(tokens).reshape(tokens.shape[0], -1).float().contiguous()     # (B, C)
    op = torch.ops.tformer_qgemv.decode_layer
    for (g1, (wqkv, wo, wg, wu, wd), g2, fmts), s in zip(p.layers, state.layers):
        op(x, g1, p.eps, wqkv, wo, g2, wg, wu, wd, fmts, p.dims, s.k, s.v, pos, cos, sin, p.path_id)
    state.valid[:, pos] = True
    state.advance(pos + 1)
    logits = model.lm_head(model.final_norm(x[:, None]))                            # (B, 1, vocab)
    return logits[:, -1]
