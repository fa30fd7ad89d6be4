"""What a model must be for its layers to run whole in one C++ call, and that choice, made once per model.

:func:`choose` checks the model against what ``layers.cpp`` implements (:func:`why_not`) and, where
it passes, gathers a :class:`Plan`: each layer's norm weights, product matrices (block tiles or
float rows), biases and formats, in the order the call reads them. The :class:`Choice` (the plan
or ``None``, and a one-line reason either way) is kept beside the model and :func:`chosen` looks it
up. It is made again only when the model's mode or its products change (``train()`` / ``eval()``,
:func:`tformer.set_precision` swapping the layers) or when :func:`choose` is called again:
``TFORMER_FUSED_DECODE`` and the forced kernel path (``TFORMER_QGEMV_PATH``) are read then, not per
token. Hooks (:mod:`tformer.interp`) are set per call, so they are no part of the choice; the call
checks them (:func:`tformer.fused.run.route`).
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import NamedTuple

import torch

import tformer.fused.library as library
from tformer.fused.pending import Pending
from tformer.nn.norms import RMSNorm
from tformer.quant import qgemv
from tformer.quant.block_linear import BlockLinear, StackedLinear
from tformer.quant.quantize import DecodeLinear

Tensor = torch.Tensor
SWITCH = "TFORMER_FUSED_DECODE"        # "0": every model takes the module path (A/B runs, tests)
FLOAT_FMT = {torch.float32: 3, torch.bfloat16: 4, torch.float16: 5}   # layers.cpp's float formats
MLP = {"gelu_tanh": 1, "relu": 2, "relu2": 3, "gelu": 4, "silu": 5}     # its plain MLPs' activations (0: SwiGLU)
GATED = {"gelu_tanh": 6, "gelu": 7}                                     # its GeGLU's gates (Gemma: tanh form)
# model -> (stamp, Choice): beside the model, not on it (generation leaves a model's attributes as they were)
_CHOICES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _products(block) -> tuple:
    """A block's matrices in the layer call's order: (qkv, o, gate, up, down) or (qkv, o, up, down)."""
    a, f = block.attn, block.ffn
    return (a.qkv_proj, a.out_proj) + ((f.gate,) if hasattr(f, "gate") else ()) + (f.up, f.down)


def _product_why_not(lin) -> str | None:
    if isinstance(lin, BlockLinear):
        return None
    if isinstance(lin, StackedLinear):       # q, k, v in different formats: split by _qkv_parts
        return None
    if type(lin) is DecodeLinear and lin.weight.dtype in FLOAT_FMT:
        return None          # a weight stored transposed for torch.mm is laid back (DecodeLinear.row_major)
    return "a product that is not a BlockLinear or a float DecodeLinear (tformer.quant.set_precision)"


def why_not(model) -> str | None:
    """``None`` if the whole-layer call implements ``model``'s layers, else the first reason it does not."""
    from tformer.mixers.attention import MultiHeadAttention
    from tformer.nn.feed_forward import MLP as PlainMLP, GeGLU, SwiGLU
    from tformer.nn.norms import RMSNorm

    if os.environ.get(SWITCH, "1") == "0":
        return f"{SWITCH}=0"
    c = getattr(model, "config", None)
    if c is None or not hasattr(model, "blocks") or not hasattr(model, "lm_head"):
        return "not a decoder LM"
    if c.norm_placement != "pre" or c.positions not in ("rope", "learned"):
        return "needs pre-norm layers and RoPE or learned positions"
    if c.embedding_norm or getattr(model, "type_emb", None) is not None:
        return "an embedding norm or a token-type table"
    if c.post_norms and c.norm != "rmsnorm":
        return "norms after the sub-layers that are not RMSNorm"
    if model.training:
        return "training mode"
    norm_type = RMSNorm if c.norm == "rmsnorm" else torch.nn.LayerNorm
    if not isinstance(model.final_norm, (RMSNorm, torch.nn.LayerNorm)):
        return "no final norm"
    for b in model.blocks:
        a, f = b.attn, b.ffn
        if type(a) is not MultiHeadAttention or b.cross_attn is not None:
            return "a layer that is not self-attention"
        if not (type(f) is SwiGLU or (type(f) is GeGLU and c.activation in GATED)
                or (type(f) is PlainMLP and c.activation in MLP)):
            return "a feed-forward that is not SwiGLU, a GELU-gated one or a GELU / ReLU / ReLU² / SiLU MLP"
        if a.alibi_slopes is not None or (a.rope is None) != (c.positions != "rope"):
            return "ALiBi"
        if a.rope is not None and a.rope is not _layer_rope(model, a):
            return "a layer whose rotary table is neither the model's nor its windowed layers' own"
        why = _qk_norm_why(a, b)
        if why:
            return why
        norms = [b.attn_norm, b.ffn_norm] + ([b.attn_post_norm, b.ffn_post_norm] if c.post_norms else [])
        if not all(type(n) is norm_type for n in norms):
            return "a norm that is neither RMSNorm nor LayerNorm"
        if any(n.eps != b.attn_norm.eps for n in norms):
            return "norms with different eps"
        if isinstance(b.attn_norm, torch.nn.LayerNorm) and not b.attn_norm.elementwise_affine:
            return "a LayerNorm without weights"
        for lin in _products(b):
            why = _product_why_not(lin)
            if why:
                return why
    # only now the kernels (their first use builds them): a model that fails above never pays for a build
    if qgemv.load() is None:
        return f"the block kernels are not built ({qgemv.STATUS.get('state')})"
    if library.load() is None:
        return f"the whole-layer kernels are not built ({library.STATUS.get('state')})"
    path = qgemv.path()
    if path not in qgemv.TILE_ROWS:
        return f"kernel path {path} has no tiles"
    return _qkv_why_not(model, path)


def _layer_rope(model, a):
    """The rotary table layer attention ``a`` should hold: its windowed layers' own (Gemma 3's local base)
    where the model has one and ``a`` is windowed, else the model's."""
    local = getattr(model, "local_rope", None)
    return local if local is not None and a.window is not None else getattr(model, "rope", None)


def _split_qkv(model) -> bool:
    """Whether the layer call takes q, k and v as three matrices: some layer stores them in different formats."""
    return any(isinstance(b.attn.qkv_proj, StackedLinear) for b in model.blocks)


def _qkv_why_not(model, path: str) -> str | None:
    """Where q, k and v go apart (:func:`_split_qkv`), each layer's must split at the q | k | v rows: a
    StackedLinear's parts are those, a tiled matrix splits only at whole tiles."""
    if not _split_qkv(model):
        return None
    c = model.config
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    for b in model.blocks:
        lin = b.attn.qkv_proj
        if isinstance(lin, StackedLinear) and [p.out_features for p in lin.parts] != [q, kv, kv]:
            return "q, k and v stacked other than as q | k | v"
        tiled = isinstance(lin, BlockLinear) and lin.tiled
        if tiled and (q % qgemv.TILE_ROWS[path] or kv % qgemv.TILE_ROWS[path]):
            return f"q, k and v in different formats beside a tiled qkv whose rows do not split at {qgemv.TILE_ROWS[path]}-row tiles"
    return None


def _qk_norm_why(a, b) -> str | None:
    """Why a layer's QK-norm cannot run in the call (``None``: none, or gains with the layer's eps)."""
    if not a.qk_norm:
        return None
    if not hasattr(a, "q_norm"):
        return "QK-norm without gains"
    if not (a.q_norm.eps == a.k_norm.eps == b.attn_norm.eps):
        return "a QK-norm whose eps differs from the layer norms'"
    return None


def _gain(norm) -> Tensor:
    """A norm's gain as the call multiplies by it, float32: :meth:`~tformer.nn.norms.RMSNorm.gain` (``1 + w``
    for Gemma's), else the LayerNorm's ``w``."""
    g = norm.gain() if isinstance(norm, RMSNorm) else norm.weight.float()
    return g.detach().contiguous()


def _qk_gains(a) -> list[Tensor]:
    """The QK-norm's gains (q, k), float32 (hs,), after the layer's norms; none without QK-norm."""
    return [_gain(a.q_norm), _gain(a.k_norm)] if a.qk_norm else []


def _norm_weights(norm) -> list[Tensor]:
    """(g,) for RMSNorm (g = 1 + w where it applies its weight so), (g, b) for LayerNorm (b zero where it
    has none), float32."""
    g = _gain(norm)
    if isinstance(norm, torch.nn.LayerNorm):
        b = norm.bias.detach().float().contiguous() if norm.bias is not None else torch.zeros_like(g)
        return [g, b]
    return [g]


def _matrix(lin, path: str) -> Tensor:
    if not isinstance(lin, BlockLinear):
        return lin.row_major()                              # the layer call reads (N, K) rows
    if not lin.tiled:
        return lin.file_layout()                            # K-quants are read in the file layout
    return lin.tiles(path)


def _bias(lin) -> Tensor | None:
    b = getattr(lin, "bias32", None) if not isinstance(lin, BlockLinear) else lin.bias
    return None if b is None else b.detach().float().contiguous()


def _format(lin) -> int:
    """layers.cpp's format number of a product."""
    return qgemv.FMT[lin.fmt] if isinstance(lin, BlockLinear) else FLOAT_FMT[lin.weight.dtype]


def _format_name(lin) -> str:
    return lin.fmt if isinstance(lin, BlockLinear) else str(lin.weight.dtype)[6:]


def _qkv_parts(lin, path: str, q: int, kv: int) -> list[tuple]:
    """``(matrix, bias, format)`` of q, k and v apart: a StackedLinear's parts, or row ranges of one
    matrix (K-quant rows, float rows or whole tiles: views, no copy)."""
    if isinstance(lin, StackedLinear):
        return [(_matrix(p, path), _bias(p), _format(p)) for p in lin.parts]
    m, b = _matrix(lin, path), _bias(lin)
    step = qgemv.TILE_ROWS[path] if isinstance(lin, BlockLinear) and lin.tiled else 1   # rows per matrix row
    cuts = [(0, q), (q, q + kv), (q + kv, q + 2 * kv)]
    return [(m[a // step:e // step], None if b is None else b[a:e], _format(lin)) for a, e in cuts]


def _layer_products(lins, path: str, split: bool, q: int, kv: int) -> tuple[list, list, list]:
    """One layer's (matrices, biases, formats) in the call's order; with ``split``, qkv as q, k, v."""
    first = _qkv_parts(lins[0], path, q, kv) if split else [(_matrix(lins[0], path), _bias(lins[0]), _format(lins[0]))]
    rest = [(_matrix(lin, path), _bias(lin), _format(lin)) for lin in lins[1:]]
    mats, biases, fmts = zip(*(first + rest))
    return list(mats), list(biases), list(fmts)


def _parts(lin) -> list:
    """A product's layers: a StackedLinear's parts, else itself."""
    return list(lin.parts) if isinstance(lin, StackedLinear) else [lin]


def _names(lin) -> list[str]:
    return [_format_name(p) for p in _parts(lin)]


class Plan:
    """What each layer's call reads, gathered once per model and kernel path (the tiles BlockLinear
    makes at its first call, made here if no call came yet; a float weight as the layer holds it).

    ``background``: the tiles are made on a thread of their own from now (:class:`~tformer.fused.pending.Pending`)
    and the plan's matrices gathered at its first use (:attr:`flat`, :attr:`layers`), which waits for
    them and raises what making them raised; what the plan decides (dims, formats, the reason) is
    known at once either way."""

    def __init__(self, model, path: str, background: bool = False):
        self.path, self.path_id = path, qgemv.PATHS.index(path)
        c = model.config
        first = model.blocks[0]
        from tformer.nn.feed_forward import GeGLU                      # as why_not reads it (the module tier)

        mlp = (GATED[c.activation] if type(first.ffn) is GeGLU else 0) if hasattr(first.ffn, "gate") else MLP[c.activation]
        self._split = _split_qkv(model)
        # dims: (nh, nkv, hs, d_ff, mlp[, qkv parts[, QK-norm[, post norms]]]), the optional entries only when needed
        self.dims = [c.n_heads, c.n_kv_heads, c.head_dim, first.ffn.up.out_features, mlp]
        if self._split or c.qk_norm or c.post_norms:
            self.dims += [3 if self._split else 1, int(c.qk_norm)] + ([1] if c.post_norms else [])
        self.eps = float(first.attn_norm.eps)
        # the attention's switches (Gemma): each layer's window (none: []), the score scale (0: 1/sqrt(hs)), the cap
        windows = [b.attn.window or 0 for b in model.blocks]
        self.windows = windows if any(windows) else []
        self.scale, self.softcap = float(c.attn_scale or 0.0), float(c.attn_softcap or 0.0)
        names: dict[str, None] = {}                        # the products' formats, in order of appearance
        for b in model.blocks:
            names.update((n, None) for lin in _products(b) for n in _names(lin))
        blocks = [n for n in names if n in qgemv.FMT]
        floats = [n for n in names if n not in qgemv.FMT]
        self.floats = bool(floats)
        self.weights = ", ".join(([", ".join(blocks) + " blocks"] if blocks else [])
                                 + ([", ".join(floats) + " weights"] if floats else []))   # e.g. "q4_1 blocks"
        self.rope = getattr(model, "rope", None) if c.positions == "rope" else None
        # the windowed layers' own table (Gemma 3's local base), where some layer uses it
        self.local_rope = getattr(model, "local_rope", None) if self.windows else None
        self.pos_emb = model.pos_emb if c.positions == "learned" else None
        self._rotary: dict = {}
        self._model_blocks, self._post_norms = list(model.blocks), c.post_norms
        self._q, self._kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        self._layers: list | None = None
        self._gathering = threading.Lock()
        self._pending, self._tiled = None, []
        if background:
            self._tiled = [p for b in model.blocks for lin in _products(b) for p in _parts(lin)
                           if isinstance(p, BlockLinear) and p.tiled]
            self._pending = Pending(lambda: [lin.tiles(path) for lin in self._tiled], "the whole-layer plan's tiles")
        else:
            self._gather()

    @property
    def layers(self) -> list:
        """Per layer ``(norm weights, matrices, biases, formats)``, waiting for the tiles the first time."""
        if self._layers is None:
            self._gather()
        return self._layers

    @property
    def flat(self) -> tuple:
        """The same, each list one layer after another: the arguments of ``tformer_fused::layers``."""
        if self._layers is None:
            self._gather()
        return self._flat

    @property
    def ready(self) -> bool:
        """Whether the plan's tiles are made (no first use will wait for them, nor raise)."""
        return self._layers is not None or (self._pending is not None and self._pending.succeeded)

    def _gather(self) -> None:
        """Gather every layer's tensors once (any number of threads may ask at once: one gathers, the others
        wait); first the background tiles: the first user makes those not yet made from the last one back
        (each layer makes its own once, whoever asks first) while the background thread goes on from the
        front, then waits for it and raises what making them raised."""
        with self._gathering:
            if self._layers is not None:
                return
            if self._pending is not None:
                if not self._pending.done:
                    threads = torch.get_num_threads()
                    torch.set_num_threads(1)               # one core each: the background thread holds the other
                    try:
                        for lin in reversed(self._tiled):  # the two meet in the middle; a made one returns at once
                            if self._pending.done:
                                break
                            lin.tiles(self.path)
                    finally:
                        torch.set_num_threads(threads)
                self._pending.wait()
            layers = []
            for b in self._model_blocks:
                mats, biases, fmts = _layer_products(_products(b), self.path, self._split, self._q, self._kv)
                post = _norm_weights(b.attn_post_norm) + _norm_weights(b.ffn_post_norm) if self._post_norms else []
                layers.append((_norm_weights(b.attn_norm) + _norm_weights(b.ffn_norm) + post + _qk_gains(b.attn), mats,
                               biases, fmts))
            self._flat = tuple([t for layer in layers for t in layer[i]] for i in range(4))
            self._layers, self._model_blocks, self._tiled = layers, None, []

    def rotary(self, rope=None) -> tuple[Tensor, Tensor]:
        """A rotary table (default the model's) in float32 (a bf16 / fp16 model holds them in its dtype),
        converted again only when the table grew (``RotaryEmbedding.ensure`` makes a new one)."""
        rope = rope if rope is not None else self.rope
        cos = rope.cos
        held = self._rotary.get(id(rope))
        if held is None or held[0] is not cos:
            pair = (cos, rope.sin) if cos.dtype == torch.float32 else (cos.float(), rope.sin.float())
            held = self._rotary[id(rope)] = (cos,) + pair
        return held[1], held[2]


class Choice(NamedTuple):
    """How a model's prompts, decode steps and speculative checks run: ``plan`` (whole layers in one
    C++ call) or ``None`` (the module path), and why, in one line: ``"whole layers in one C++ call
    (avx512vnni kernels, q4_1 blocks)"`` or ``"module path: ALiBi"``."""
    plan: Plan | None
    reason: str


def _stamp(model) -> tuple:
    """What a choice depends on that can change on a model: its mode and its layers' products
    (set_precision swaps them; a Mamba model has no ``qkv_proj``)."""
    blocks = getattr(model, "blocks", None)
    first = getattr(getattr(blocks[0], "attn", None), "qkv_proj", None) if blocks is not None and len(blocks) else None
    return getattr(model, "training", None), first


def choose(model, background: bool = False) -> Choice:
    """Make ``model``'s choice now (and keep it): reads ``TFORMER_FUSED_DECODE`` and the kernel path,
    gathers the plan where the model passes. Call it again after changing either. ``background``: the
    plan's tiles are made on their own thread, waited for at the plan's first use (:class:`Plan`)."""
    why = why_not(model)
    if why is None:
        plan = Plan(model, qgemv.path(), background)
        choice = Choice(plan, f"whole layers in one C++ call ({plan.path} kernels, {plan.weights})")
    else:
        choice = Choice(None, f"module path: {why}")
    _CHOICES[model] = (_stamp(model), choice)
    return choice


def chosen(model) -> Choice:
    """``model``'s choice: the one kept, unless its mode or products changed since (then made again)."""
    held = _CHOICES.get(model)
    if held is not None and held[0] == _stamp(model):
        return held[1]
    return choose(model)
