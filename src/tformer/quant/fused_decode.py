"""One C++ call per layer for a block-quantised Llama-shaped model: a decode step, a prompt, a
speculative check.

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
float32; and a call it can serve over float32 caches: :func:`forward`, ``T`` new tokens per row after
the same ``state.length`` tokens every row holds without padding (an eager state: ``generate``'s
prefill and steps, ``extend``; or the server pool's prefill writer and row views), and
:func:`decode`'s static step (the server's pool: per-row write index, position and real keys).
``TFORMER_FUSED_DECODE=0`` turns it off (A/B runs, tests of the module path).
"""

from __future__ import annotations

import os
import weakref

import torch

from tformer.quant import qgemv
from tformer.quant.block_linear import BlockLinear

Tensor = torch.Tensor
SWITCH = "TFORMER_FUSED_DECODE"
# new tokens per row above which forward() leaves a prompt to the module path, whose attention kernel
# wins on long prompts: SmolLM2 q4_1, 2 threads, fused / module prefill time 0.68 (32 tokens), 0.82
# (128), 0.95 (256), 1.07 (512)
MAX_TOKENS = 256
# model -> (key, Plan or None, reason): kept beside the model, not on it (generation leaves a model's
# attributes as they were)
_PLANS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


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
    # only now the kernels (their first use builds them): a float model never pays for the build
    if qgemv.load() is None:
        return "the kernels are not built"
    path = qgemv.path()
    if path not in qgemv.TILE_ROWS:
        return f"kernel path {path} has no tiles"
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
    (:func:`reason` says why). Made once per model; made again when the forced kernel path, the
    mode or the layers' products change (set_precision swaps them)."""
    blocks = getattr(model, "blocks", None)
    first = getattr(blocks[0].attn, "qkv_proj", None) if blocks is not None and len(blocks) else None
    key = (os.environ.get(qgemv.FORCED), model.training, id(first))
    cached = _PLANS.get(model)
    if cached is not None and cached[0] == key:
        return cached[1]
    why = _why_not(model)
    p = Plan(model, qgemv.path()) if why is None else None
    _PLANS[model] = (key, p, why)
    return p


def reason(model) -> str | None:
    """Why :func:`plan` gave ``None`` for ``model`` (``None``: it has a plan, or none was asked yet)."""
    cached = _PLANS.get(model)
    return cached[2] if cached is not None else None


def _caches_fit(state, B: int) -> bool:
    """Every layer of a static state is a float32 StaticKVCache of ``B`` rows the kernel can read."""
    from tformer.mixers.kv_cache import StaticKVCache

    return all(type(s) is StaticKVCache and _float_cache(s) and s.k.shape[0] == B for s in state.layers)


def _float_cache(s) -> bool:
    return s.k.dtype == torch.float32 and s.k.stride(3) == 1 and s.k.stride() == s.v.stride()


def enabled() -> bool:
    return os.environ.get(SWITCH, "1") != "0"


def _usable(model) -> Plan | None:
    if not enabled() or getattr(model, "hooks", None) is not None:   # hooks are set per call (interp), so never in the cached plan
        return None
    return plan(model)


def _layers(p: Plan, x: Tensor, caches: list[tuple[Tensor, Tensor]], write: Tensor, at: Tensor,
            valid: Tensor | None, rows: Tensor | None) -> None:
    """Every layer's fused call on ``x (N, C)`` in place: token ``i`` of cache row ``rows[i]`` (``i``
    without ``rows``) writes at ``write[i]``, is rotated at ``at[i]``, reads keys ``j <= write[i]``
    (those ``valid`` marks real)."""
    op = torch.ops.tformer_qgemv.decode_layer
    for (g1, (wqkv, wo, wg, wu, wd), g2, fmts), (k, v) in zip(p.layers, caches):
        op(x, g1, p.eps, wqkv, wo, g2, wg, wu, wd, fmts, p.dims, k, v, write, at, valid, rows,
           p.rope.cos, p.rope.sin, p.path_id)


def decode(model, tokens: Tensor, state, positions: Tensor | None = None,
           attention_mask: Tensor | None = None) -> Tensor | None:
    """The fused decode step: ``tokens (B, 1)`` -> logits ``(B, vocab)``, writing every layer's cache
    and advancing the state as the module path does; ``None`` (nothing touched) when it does not apply.

    Eager state: no ``positions`` or ``attention_mask``, every row holding ``state.length`` real
    tokens; each row writes and is rotated at ``state.length``. Static state (the server's pool):
    row ``b`` writes at ``state.index[b]``, is rotated at ``positions[b]`` (default: its count of
    real tokens held) and attends over the keys ``state.valid`` marks real up to that index (its
    own token real unless ``attention_mask`` says padding); ``state.index`` then advances by one.
    """
    if state is None or tokens.dim() != 2 or tokens.shape[1] != 1:
        return None
    static = bool(getattr(state, "static", False))
    if not static:                              # one new token after the held ones: forward()'s case
        if positions is not None or attention_mask is not None:
            return None
        logits = forward(model, tokens, state, last_only=True)
        return None if logits is None else logits[:, -1]
    p = _usable(model)
    B = tokens.shape[0]
    if p is None or not state.layers or not _caches_fit(state, B):
        return None
    L = state.layers[0].k.shape[2]
    index = state.index                                                             # (B,)
    if int(index.max()) >= L:
        return None                                      # the module path says what is wrong
    at = positions[:, -1] if positions is not None else state.valid.sum(-1)        # (B,) before this token
    real = attention_mask[:, -1].bool() if attention_mask is not None else True
    state.valid[torch.arange(B), index] = real
    p.rope.ensure(max(L, state.max_len))
    x = model.tok_emb(tokens).reshape(B, -1).float().contiguous()                  # (B, C)
    _layers(p, x, [(s.k, s.v) for s in state.layers], index.contiguous(), at.long().contiguous(),
            state.valid, None)
    state.index.add_(1)
    logits = model.lm_head(model.final_norm(x[:, None]))                            # (B, 1, vocab)
    return logits[:, -1]


def forward(model, ids: Tensor, state, *, last_index: Tensor | None = None, last_only: bool = False) -> Tensor | None:
    """``T`` new tokens per row through the fused layers, after the ``state.length`` tokens every row
    holds: ``ids (B, T)`` -> logits ``(B, T, vocab)`` (``(B, 1, vocab)`` at ``last_index[b]`` or the
    last token), written into the caches at ``state.length + t`` and rotated there, token ``t``
    attending causally to the held tokens and the new ones up to itself (the cache is written before
    anyone attends; see qgemv.cpp). What :func:`tformer.generation.step.prefill` (a prompt,
    right-padded under ``last_index``) and :func:`~tformer.generation.step.extend` (a speculative
    check) run on a block-quantised model; ``None`` (nothing touched) where it does not apply.

    It applies to an eager state (or a row view of the server's static pool with ``length`` set)
    whose rows hold their tokens without padding, and to a pool writer (``state.writer(rows,
    start)``: its layers write rows ``rows`` of the pool's caches), for at most
    :data:`MAX_TOKENS` new tokens per row: the fused attention visits every (query, key) pair, and a
    long prompt is faster through the module path's attention kernel, its per-op cost then amortised.
    :func:`decode` on an eager state is this with one token.
    """
    from tformer.mixers.kv_cache import KVCache, RowWriter

    if state is None or ids.dim() != 2 or not 1 <= ids.shape[1] <= MAX_TOKENS or not state.layers:
        return None
    p = _usable(model)
    if p is None:
        return None
    B, T = ids.shape
    pos = state.length
    if pos + T > state.max_len:
        return None                                      # the module path says what is wrong
    layers = state.layers
    if all(isinstance(s, KVCache) and s.k.shape[0] == B and _float_cache(s) for s in layers):
        caches, slots = [(s.k, s.v) for s in layers], torch.arange(B)
    elif all(type(s) is RowWriter and isinstance(s.cache, KVCache) and _float_cache(s.cache)
             and s.slots is layers[0].slots for s in layers):
        caches, slots = [(s.cache.k, s.cache.v) for s in layers], layers[0].slots.long()
    else:
        return None
    if pos and not bool(state.valid[:, :pos].all()):
        return None                                      # held padding: the module path's masks
    p.rope.ensure(max(pos + T, caches[0][0].shape[2]))
    where = torch.arange(pos, pos + T).repeat(B)                                   # (B T,) index = position
    x = model.tok_emb(ids).reshape(B * T, -1).float().contiguous()                 # (B T, C)
    _layers(p, x, caches, where, where, None, slots.repeat_interleave(T).contiguous())
    state.valid[:, pos:pos + T] = True
    state.advance(pos + T)
    x = x.view(B, T, -1)
    if last_index is not None:
        x = x[torch.arange(B), last_index][:, None]                                # (B, 1, C)
    elif last_only:
        x = x[:, -1:]
    return model.lm_head(model.final_norm(x))                                      # (B, T|1, vocab)
