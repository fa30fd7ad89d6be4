"""One C++ call per layer for an inference model's decode step, prompt or speculative check.

A decode step of SmolLM2-135M is 30 layers of ~50 small torch ops each (norms, RoPE, the cache
write, attention over the cache, SiLU, residual adds) around 5 products: at 576 wide the Python
and dispatch cost of those ops is about as large as reading the weights (and at GPT-2's 768 wide,
~6 ms a token). :func:`decode` runs the layers in one call of ``tformer_qgemv::decode_layers``
(qgemv.cpp: ``decode_layer``, "one fused decode layer", for each), for the two block shapes tformer's models come in:

    Llama:  h = RMSNorm(x) g;  [q|k|v] = h Wqkvᵀ;  RoPE(q, k) at pos;  K[pos], V[pos] <- k, v
            x += softmax(q Kᵀ / sqrt(hs)) V · Woᵀ          (GQA: head h reads kv head h // (nh/nkv))
            h = RMSNorm(x) g;  x += (silu(h Wgᵀ) * (h Wuᵀ)) Wdᵀ
    GPT-2:  the same with LayerNorm (g, b), a bias on every product, no rotation (the learned
            position is added to the token embedding before the first layer) and
            x += act(h Wuᵀ + b) Wdᵀ + b  (act: GELU, tanh or erf form; ReLU; ReLU²; SiLU)

then the final norm and the LM head as modules. A product is a :class:`BlockLinear`'s tiles (the
same tile kernels and activation quantisation as the module path, so those products are its to the
bit) or a float :class:`~tformer.quant.quantize.DecodeLinear`'s weight (float32, bfloat16 or
float16, widened in registers by the loops tformer's GEMV uses); the norm, softmax and weighted sum
differ from the module path only in float summation order. The residual stream is float32 in
every case (a bf16 / fp16 model's module path rounds it after every op); the KV cache keeps the
model's dtype.

It applies when everything it does not implement is absent (:func:`plan` says why not, and then
the module path runs unchanged): a pre-norm stack of
:class:`~tformer.mixers.attention.MultiHeadAttention` layers with RMSNorm + SwiGLU + RoPE
(rotate-half) or LayerNorm + a GELU / ReLU / ReLU² / SiLU MLP + learned positions, without QK-norm, sliding
window, ALiBi, logit soft-cap or hooks, every product a BlockLinear on a SIMD tile path or a float
DecodeLinear (what :func:`tformer.quant.set_precision` makes); and a call it can serve: :func:`forward`,
``T`` new tokens per row after the same ``state.length`` tokens every row holds without padding (an
eager state: ``generate``'s prefill and steps, ``extend``; or the server pool's prefill writer and
row views), and :func:`decode`'s static step (the server's pool: per-row write index, position and
real keys). ``TFORMER_FUSED_DECODE=0`` turns it off (A/B runs, tests of the module path).
"""

from __future__ import annotations

import os
import weakref

import torch

from tformer.mixers.kv_cache import KVCache, RowWriter
from tformer.quant import qgemv
from tformer.quant.block_linear import BlockLinear
from tformer.quant.quantize import DecodeLinear

Tensor = torch.Tensor
SWITCH = "TFORMER_FUSED_DECODE"
# new tokens per row above which forward() leaves a prompt to the module path, whose attention kernel
# wins on long prompts: SmolLM2 q4_1, 2 threads, fused / module prefill time 0.68 (32 tokens), 0.82
# (128), 0.95 (256), 1.07 (512)
MAX_TOKENS = 256
# rows (tokens x batch rows) above which a call on float weights goes to the module path: the fused
# float product reads each weight row once per token (a GEMV per row), torch's GEMM far less often
MAX_FLOAT_ROWS = 8
# model -> (key, Plan or None, reason): kept beside the model, not on it (generation leaves a model's
# attributes as they were)
_PLANS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
# state -> (its list of layers, batch rows, what _layout found): beside the state, as the plans are
_LAYOUTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


FLOAT_FMT = {torch.float32: 3, torch.bfloat16: 4, torch.float16: 5}   # qgemv.cpp's float formats
MLP = {"gelu_tanh": 1, "relu": 2, "relu2": 3, "gelu": 4, "silu": 5}     # its plain MLPs' activations (0: SwiGLU)


def _products(block) -> tuple:
    """A block's matrices in the fused layer's order: (qkv, o, gate, up, down) or (qkv, o, up, down)."""
    a, f = block.attn, block.ffn
    return (a.qkv_proj, a.out_proj) + ((f.gate,) if hasattr(f, "gate") else ()) + (f.up, f.down)


def _product_why_not(lin) -> str | None:
    if isinstance(lin, BlockLinear):
        return None
    if type(lin) is DecodeLinear and lin.weight.dtype in FLOAT_FMT:
        return None          # a weight stored transposed for torch.mm is laid back (DecodeLinear.row_major)
    return "a product that is not a BlockLinear or a float DecodeLinear (tformer.quant.set_precision)"


def _why_not(model) -> str | None:
    """``None`` if the fused layer implements ``model``'s decode step, else the first reason it does not."""
    from tformer.mixers.attention import MultiHeadAttention
    from tformer.nn.feed_forward import MLP as PlainMLP, SwiGLU
    from tformer.nn.norms import RMSNorm

    c = getattr(model, "config", None)
    if c is None or not hasattr(model, "blocks") or not hasattr(model, "lm_head"):
        return "not a decoder LM"
    if c.norm_placement != "pre" or c.positions not in ("rope", "learned"):
        return "needs pre-norm layers and RoPE or learned positions"
    if c.logit_softcap or c.embedding_norm or c.embedding_scale or getattr(model, "type_emb", None) is not None:
        return "a soft-cap, an embedding norm or scale, or a token-type table"
    if model.training or model.hooks is not None:
        return "training or hooks"
    norm_type = RMSNorm if c.norm == "rmsnorm" else torch.nn.LayerNorm
    if not isinstance(model.final_norm, (RMSNorm, torch.nn.LayerNorm)):
        return "no final norm"
    for b in model.blocks:
        a, f = b.attn, b.ffn
        if type(a) is not MultiHeadAttention or b.cross_attn is not None:
            return "a layer that is not self-attention"
        if not (isinstance(f, SwiGLU) or (type(f) is PlainMLP and c.activation in MLP)):
            return "a feed-forward that is not SwiGLU or a GELU / ReLU / ReLU² / SiLU MLP"
        if a.qk_norm or a.window is not None or a.alibi_slopes is not None or (a.rope is None) != (c.positions != "rope"):
            return "QK-norm, a window or ALiBi"
        if not (type(b.attn_norm) is norm_type and type(b.ffn_norm) is norm_type):
            return "a norm that is neither RMSNorm nor LayerNorm"
        if b.attn_norm.eps != b.ffn_norm.eps:
            return "norms with different eps"
        if isinstance(b.attn_norm, torch.nn.LayerNorm) and not b.attn_norm.elementwise_affine:
            return "a LayerNorm without weights"
        for lin in _products(b):
            why = _product_why_not(lin)
            if why:
                return why
    # only now the kernels (their first use builds them): a float model never pays for the build
    if qgemv.load() is None:
        return "the kernels are not built"
    path = qgemv.path()
    if path not in qgemv.TILE_ROWS:
        return f"kernel path {path} has no tiles"
    return None


def _norm_weights(norm) -> list[Tensor]:
    """(g,) for RMSNorm, (g, b) for LayerNorm (b zero where it has none), float32."""
    g = norm.weight.detach().float().contiguous()
    if isinstance(norm, torch.nn.LayerNorm):
        b = norm.bias.detach().float().contiguous() if norm.bias is not None else torch.zeros_like(g)
        return [g, b]
    return [g]


class Plan:
    """What each layer's call reads, gathered once per model and kernel path (the tiles BlockLinear
    makes at its first call, made here if no call came yet; a float weight as the layer holds it)."""

    def __init__(self, model, path: str):
        self.path, self.path_id = path, qgemv.PATHS.index(path)
        c = model.config
        first = model.blocks[0]
        mlp = 0 if hasattr(first.ffn, "gate") else MLP[c.activation]
        self.dims = [c.n_heads, c.n_kv_heads, c.head_dim, first.ffn.up.out_features, mlp]
        self.eps = float(first.attn_norm.eps)
        self.layers = []
        for b in model.blocks:
            lins = _products(b)
            mats = [_matrix(lin, path) for lin in lins]
            fmts = [qgemv.FMT[lin.fmt] if isinstance(lin, BlockLinear) else FLOAT_FMT[lin.weight.dtype] for lin in lins]
            biases = [_bias(lin) for lin in lins]
            self.layers.append((_norm_weights(b.attn_norm) + _norm_weights(b.ffn_norm), mats, biases, fmts))
        # the same, each list one layer after another: decode_layers' arguments
        self.flat = tuple([t for layer in self.layers for t in layer[i]] for i in range(4))
        self.floats = any(f >= 3 for layer in self.layers for f in layer[3])
        self.rope = first.attn.rope
        self.pos_emb = model.pos_emb if c.positions == "learned" else None
        self._rotary: tuple = (None, None, None)

    def rotary(self) -> tuple[Tensor, Tensor]:
        """The rotary tables in float32 (a bf16 / fp16 model holds them in its dtype), converted
        again only when the table grew (``RotaryEmbedding.ensure`` makes a new one)."""
        cos = self.rope.cos
        if self._rotary[0] is not cos:
            pair = (cos, self.rope.sin) if cos.dtype == torch.float32 else (cos.float(), self.rope.sin.float())
            self._rotary = (cos,) + pair
        return self._rotary[1], self._rotary[2]


def _matrix(lin, path: str) -> Tensor:
    if not isinstance(lin, BlockLinear):
        return lin.row_major()                              # the fused layer reads (N, K) rows
    t = lin._tiled.get(path)
    if t is None:
        t = lin._tiled[path] = qgemv.tiles(lin.blocks, lin.fmt, path)
    return t


def _bias(lin) -> Tensor | None:
    b = getattr(lin, "bias32", None) if not isinstance(lin, BlockLinear) else lin.bias
    return None if b is None else b.detach().float().contiguous()


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


def _float_cache(s) -> bool:
    return s.k.dtype in FLOAT_FMT and s.k.stride(3) == 1 and s.k.stride() == s.v.stride() and s.v.dtype == s.k.dtype


def enabled() -> bool:
    return os.environ.get(SWITCH, "1") != "0"


def _usable(model) -> Plan | None:
    if not enabled() or getattr(model, "hooks", None) is not None:   # hooks are set per call (interp), so never in the cached plan
        return None
    return plan(model)


def run_layers(p: Plan, x: Tensor, caches: list[tuple[Tensor, Tensor]], write: Tensor, at: Tensor,
            valid: Tensor | None, rows: Tensor | None) -> None:
    """Every layer's fused call on ``x (N, C)`` in place, in one call of ``decode_layers``: token ``i``
    of cache row ``rows[i]`` (``i`` without ``rows``) writes at ``write[i]``, is rotated at ``at[i]``,
    reads keys ``j <= write[i]`` (those ``valid`` marks real)."""
    cos, sin = p.rotary() if p.rope is not None else (None, None)
    norms, mats, biases, fmts = p.flat
    torch.ops.tformer_qgemv.decode_layers(x, norms, p.eps, mats, biases, fmts, p.dims, [k for k, _ in caches],
                                          [v for _, v in caches], write, at, valid, rows, cos, sin, p.path_id)


def _embed(model, p: Plan, ids: Tensor, at: Tensor) -> Tensor:
    """``ids (N,)`` at positions ``at (N,)`` -> the float32 residual stream ``(N, C)``: the token
    embedding, plus the learned position's where the model has a table."""
    x = model.tok_emb(ids).float()
    if p.pos_emb is not None:
        x = x + p.pos_emb(at).float()
    return x.contiguous()


def _head(model, x: Tensor) -> Tensor:
    """Final norm and LM head as modules, in the model's dtype (the fused stream is float32)."""
    return model.lm_head(model.final_norm(x.to(model.tok_emb.weight.dtype)))


def _ensure_rope(p: Plan, n: int) -> None:
    if p.rope is not None:
        p.rope.ensure(n)


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
    layout = _layout(state, B) if p is not None and state.layers else None
    if layout is None or layout[2]:
        return None                                      # no plan, or caches the kernel cannot read, or a writer
    L = state.layers[0].k.shape[2]
    index = state.index                                                             # (B,)
    if int(index.max()) >= L:
        return None                                      # the module path says what is wrong
    at = positions[:, -1] if positions is not None else state.valid.sum(-1)        # (B,) before this token
    real = attention_mask[:, -1].bool() if attention_mask is not None else True
    state.valid[torch.arange(B), index] = real
    _ensure_rope(p, max(L, state.max_len))
    at = at.long().contiguous()
    x = _embed(model, p, tokens.reshape(B), at)                                     # (B, C)
    run_layers(p, x, layout[0], index.contiguous(), at, state.valid, None)
    state.index.add_(1)
    logits = _head(model, x[:, None])                                               # (B, 1, vocab)
    return logits[:, -1]


def _layout(state, B: int) -> tuple[list, Tensor, bool] | None:
    """What the kernel reads for ``state``'s ``B`` rows: the caches ``(k, v)`` per layer, the cache row
    of each row, and whether the layers are a pool writer's (``state.writer``: rows of a larger cache,
    which only :func:`forward` serves); ``None`` where the kernel cannot read the caches. Asked once
    per state and batch, not per token (:func:`decode` on the server's pool and :func:`forward` both
    ask; a KVCache keeps its tensors for its life, and a new list of layers asks again)."""
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
    if state is None or ids.dim() != 2 or not 1 <= ids.shape[1] <= MAX_TOKENS or not state.layers:
        return None
    p = _usable(model)
    if p is None or (p.floats and ids.shape[0] * ids.shape[1] > MAX_FLOAT_ROWS):
        return None
    B, T = ids.shape
    pos = state.length
    if pos + T > state.max_len:
        return None                                      # the module path says what is wrong
    layout = _layout(state, B)
    if layout is None:
        return None
    caches, slots, _ = layout
    if pos and not bool(state.valid[:, :pos].all()):
        return None                                      # held padding: the module path's masks
    _ensure_rope(p, max(pos + T, caches[0][0].shape[2]))
    where = torch.arange(pos, pos + T)
    where = where.repeat(B) if B > 1 else where                                     # (B T,) index = position
    x = _embed(model, p, ids.reshape(B * T), where)                                # (B T, C)
    run_layers(p, x, caches, where, where, None, slots.repeat_interleave(T).contiguous() if T > 1 else slots)
    state.valid[:, pos:pos + T] = True
    state.advance(pos + T)
    x = x.view(B, T, -1)
    if last_index is not None:
        x = x[torch.arange(B), last_index][:, None]                                # (B, 1, C)
    elif last_only:
        x = x[:, -1:]
    return _head(model, x)                                                         # (B, T|1, vocab)
