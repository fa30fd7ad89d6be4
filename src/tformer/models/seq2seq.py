"""Encoder-decoder transformer (Vaswani et al., 2017): translate a source sequence into a target.

    src (B, S) -> shared embedding (x sqrt(d) if embedding_scale) + positions -> encoder_layers x Block
               -> memory (B, S, C)
    tgt (B, T) -> shared embedding + positions -> n_layers x Block(causal self-attention,
               cross-attention over memory, feed-forward) -> [final norm] -> tied head -> logits (B, T, V)

The source and target share one token matrix, which is also the output projection (the paper's
§3.4 tying). Padding is masked on both sides: the encoder and the cross-attention never read a
source pad, and the decoder's self-attention never reads a target pad. Positions count real
tokens only, so left and right padding give the same logits for real tokens.

Decoding keeps a per-request :class:`Seq2SeqState`: the encoder runs once, each decoder layer's
cross-attention keys/values are projected from the memory once, and each layer's self-attention
keeps a KV cache of the target prefix.
"""

from __future__ import annotations

import dataclasses
import math
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

from tformer.attention.functional import scaled_dot_product_attention
from tformer.attention.masks import padding_mask
from tformer.attention.multihead import MultiHeadAttention
from tformer.config import TransformerConfig
from tformer.errors import ConfigError, InputError
from tformer.inference.kv_cache import KVCache
from tformer.layers import Block, make_norm
from tformer.models.embedding import check_ids, init_weights, position_table

Tensor = torch.Tensor


class CrossAttention(MultiHeadAttention):
    """Encoder-decoder attention whose keys/values may come precomputed.

    ``context`` is either the memory ``(B, S, C)`` (projected on every call: training) or the pair
    ``(k, v)`` of ``(B, n_kv_heads, S, head_dim)`` tensors that :meth:`project` returned (decoding:
    projected once per source). Set ``keep_weights`` to store the last attention weights in
    ``last_weights`` ``(B, n_heads, T, S)`` (alignment plots; math backend).
    """

    def __init__(self, config: TransformerConfig):
        super().__init__(config, cross=True)
        self.keep_weights, self.last_weights = False, None

    def project(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Memory ``(B, S, C)`` -> keys, values ``(B, n_kv_heads, S, head_dim)``."""
        B, S, _ = memory.shape
        k, v = self.kv_proj(memory).split(self.n_kv_heads * self.head_dim, dim=-1)     # (B, S, nkv*hs) each
        return (k.view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2),
                v.view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2))

    def forward(self, x: Tensor, *, context, mask: Tensor | None = None, **_) -> Tensor:
        B, T, _ = x.shape
        k, v = context if isinstance(context, tuple) else self.project(context)       # (B, nkv, S, hs)
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)     # (B, nh, T, hs)
        out = scaled_dot_product_attention(
            q, k, v, mask=mask, dropout_p=self.attn_dropout if self.training else 0.0,
            backend="math" if self.keep_weights else self.backend, return_weights=self.keep_weights)
        if self.keep_weights:
            out, self.last_weights = out
        return self.out_proj(out.transpose(1, 2).reshape(B, T, -1))                   # (B, T, C)


@dataclasses.dataclass
class Seq2SeqState:
    """One request's decoding state: what the decoder needs besides the next tokens.

    Attributes:
        cross: per decoder layer, the cross-attention keys/values ``(B, nkv, S, hs)``, from the memory once.
        caches: per decoder layer, the self-attention :class:`KVCache` of the target prefix.
        src_mask: ``(B, S)`` 1 = real source token, or ``None``.
        length: target tokens held so far.
    """

    cross: list[tuple[Tensor, Tensor]]
    caches: list[KVCache]
    src_mask: Tensor | None
    length: int = 0

    def repeat(self, k: int) -> "Seq2SeqState":
        """Each sequence ``k`` times in a row (beam search: beams of one source are adjacent)."""
        rep = lambda t: t.repeat_interleave(k, dim=0)                                      # noqa: E731
        caches = []
        for c in self.caches:
            new = KVCache(c.k.shape[0] * k, c.k.shape[1], c.max_len, c.k.shape[3], c.k.dtype, c.k.device)
            new.k.copy_(rep(c.k)), new.v.copy_(rep(c.v))
            caches.append(new)
        mask = None if self.src_mask is None else rep(self.src_mask)
        return Seq2SeqState([(rep(k_), rep(v_)) for k_, v_ in self.cross], caches, mask, self.length)

    def reorder(self, index: Tensor) -> None:
        """Keep sequence ``index[i]`` in row ``i`` (beam search); ``index`` stays within each source's
        group of rows, so the cross-attention keys/values need no reordering."""
        for c in self.caches:
            c.k.copy_(c.k.index_select(0, index)), c.v.copy_(c.v.index_select(0, index))

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches) + sum(k.nbytes + v.nbytes for k, v in self.cross)


class EncoderDecoder(nn.Module):
    """The encoder-decoder transformer.

    Args:
        config: every switch; ``n_layers`` decoder blocks, ``encoder_layers`` encoder blocks,
            ``embedding_scale`` for the sqrt(d) factor, ``embedding_norm`` for a norm after each
            side's embedding (BART). ``causal`` must be True (it describes the decoder).
    Buffers:
        logits_bias: ``(vocab,)`` added to the logits (zeros; Marian's and BART's ``final_logits_bias``).
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        if not config.causal or config.type_vocab_size:
            raise ConfigError("model='encoder-decoder' needs causal=True (its decoder is causal) and "
                              "type_vocab_size=0; fix those fields.")
        if config.positions in ("rope", "alibi"):
            raise ConfigError(f"model='encoder-decoder' takes absolute positions, not positions={config.positions!r}; "
                              f"use sinusoidal (Vaswani) or learned (BART).")
        self.config = c = config
        enc = dataclasses.replace(c, causal=False, n_layers=c.encoder_layers or c.n_layers, model="encoder")
        self.tok_emb = nn.Embedding(c.vocab_size, c.d_model)                 # shared by source, target, head
        self.emb_scale = math.sqrt(c.d_model) if c.embedding_scale else 1.0
        self.enc_pos, self.dec_pos = position_table(c), position_table(c)    # BART learns one per side
        self.enc_emb_norm = make_norm(c) if c.embedding_norm else None
        self.dec_emb_norm = make_norm(c) if c.embedding_norm else None
        self.drop = nn.Dropout(c.dropout)
        self.encoder = nn.ModuleList(Block(enc) for _ in range(enc.n_layers))
        self.decoder = nn.ModuleList(Block(c, cross_attention=True) for _ in range(c.n_layers))
        for block in self.decoder:
            block.cross_attn = CrossAttention(c)
        pre = c.norm_placement == "pre"                                       # pre-norm stacks end in a norm
        self.enc_norm = make_norm(c) if pre else nn.Identity()
        self.dec_norm = make_norm(c) if pre else nn.Identity()
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight
        self.register_buffer("logits_bias", torch.zeros(c.vocab_size))
        self.apply(lambda m: init_weights(m, c.init_std))
        depth = enc.n_layers + c.n_layers
        for name, p in self.named_parameters():
            if name.endswith(("out_proj.weight", "ffn.down.weight")):
                nn.init.normal_(p, mean=0.0, std=c.init_std / math.sqrt(2 * depth))

    # ------------------------------------------------------------------------------------ pieces
    def _embed(self, ids: Tensor, positions: Tensor, table, norm) -> Tensor:
        check_ids(ids, self.config.vocab_size)
        x = self.tok_emb(ids) * self.emb_scale                                          # (B, T, C)
        if table is not None:
            x = x + table(positions)
        return self.drop(norm(x) if norm is not None else x)

    @staticmethod
    def _positions(ids: Tensor, mask: Tensor | None, start: int = 0) -> Tensor:
        """Each token's count of real tokens before it (so padding on either side shifts nothing)."""
        if mask is None:
            return torch.arange(start, start + ids.shape[1], device=ids.device)        # (T,)
        return (mask.long().cumsum(dim=-1) - 1).clamp(min=0)                            # (B, T)

    def encode(self, src: Tensor, src_mask: Tensor | None = None) -> Tensor:
        """Source ids ``(B, S)`` (``src_mask`` 1 = token, 0 = pad) -> memory ``(B, S, C)``."""
        x = self._embed(src, self._positions(src, src_mask), self.enc_pos, self.enc_emb_norm)
        mask = padding_mask(src_mask) if src_mask is not None else None
        for block in self.encoder:
            x = block(x, mask=mask)
        return self.enc_norm(x)

    def decode(self, tgt: Tensor, memory: Tensor | None = None, *, src_mask: Tensor | None = None,
               tgt_mask: Tensor | None = None, state: Seq2SeqState | None = None) -> Tensor:
        """Target ids ``(B, T)`` -> logits ``(B, T, V)``, reading ``memory`` (training, recomputation)
        or the cached ``state`` (decoding; it advances by ``T``)."""
        start = state.length if state is not None else 0
        if state is not None:
            src_mask = state.src_mask
            if start + tgt.shape[1] > state.caches[0].max_len:
                raise InputError(f"the decoding state holds {state.caches[0].max_len} target tokens; "
                                 f"make it with a larger max_len.")
        x = self._embed(tgt, self._positions(tgt, tgt_mask, start), self.dec_pos, self.dec_emb_norm)
        self_mask = padding_mask(tgt_mask) if tgt_mask is not None else None
        cross_mask = padding_mask(src_mask) if src_mask is not None else None
        for i, block in enumerate(self.decoder):
            context = state.cross[i] if state is not None else memory
            with _cache(block, state.caches[i] if state is not None else None):
                x = block(x, mask=self_mask, start_pos=start, context=context, context_mask=cross_mask)
        if state is not None:
            state.length += tgt.shape[1]
        return self.lm_head(self.dec_norm(x)) + self.logits_bias                       # (B, T, V)

    # ---------------------------------------------------------------------------- the interface
    def forward(self, src: Tensor, tgt: Tensor, targets: Tensor | None = None, *, src_mask: Tensor | None = None,
                tgt_mask: Tensor | None = None, label_smoothing: float = 0.0) -> tuple[Tensor, Tensor | None]:
        """Teacher-forced logits ``(B, T, V)`` for decoder inputs ``tgt``, and the label-smoothed
        cross-entropy against ``targets`` (``-100`` = ignore) if given:
        ``(1 - ε) · (-log p_y) + ε · mean_v(-log p_v)`` (Szegedy et al.; Vaswani et al. use ε = 0.1)."""
        logits = self.decode(tgt, self.encode(src, src_mask), src_mask=src_mask, tgt_mask=tgt_mask)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100,
                                   label_smoothing=label_smoothing)
        return logits, loss

    @torch.no_grad()
    def new_state(self, src: Tensor, src_mask: Tensor | None = None, max_len: int = 128) -> Seq2SeqState:
        """Encode ``src`` once and make the decoding state: cross-attention keys/values per layer,
        empty self-attention caches for ``max_len`` target tokens."""
        memory = self.encode(src, src_mask)
        c, B = self.config, src.shape[0]
        cross = [block.cross_attn.project(memory) for block in self.decoder]
        caches = [KVCache(B, c.n_kv_heads, max_len, c.head_dim, memory.dtype, memory.device) for _ in self.decoder]
        return Seq2SeqState(cross, caches, src_mask, 0)

    def decode_step(self, tokens: Tensor, state: Seq2SeqState) -> Tensor:
        """Logits ``(B, T, V)`` for the next ``tokens (B, T)``, advancing ``state``."""
        return self.decode(tokens, state=state)

    @torch.no_grad()
    def cross_attention_maps(self, src: Tensor, tgt: Tensor, src_mask: Tensor | None = None) -> list[Tensor]:
        """Cross-attention weights of every decoder layer, ``n_layers x (B, n_heads, T, S)``."""
        for block in self.decoder:
            block.cross_attn.keep_weights = True
        try:
            self.decode(tgt, self.encode(src, src_mask), src_mask=src_mask)
            return [block.cross_attn.last_weights for block in self.decoder]
        finally:
            for block in self.decoder:
                block.cross_attn.keep_weights, block.cross_attn.last_weights = False, None

    def num_parameters(self, trainable_only: bool = False) -> int:
        """Distinct parameters (the shared matrix counts once)."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)


@contextmanager
def _cache(block: Block, cache: KVCache | None):
    """Lend ``cache`` (a request's) to ``block``'s self-attention for one call."""
    block.attn.kv_cache = cache
    try:
        yield
    finally:
        block.attn.kv_cache = None
