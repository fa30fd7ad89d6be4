"""Encoder-decoder transformer (Vaswani et al., 2017): translate a source sequence into a target.

    src (B, S) -> shared embedding (x sqrt(d) if embedding_scale) + positions -> encoder_layers x Block
               -> memory (B, S, C)
    tgt (B, T) -> shared embedding + positions -> n_layers x Block(causal self-attention,
               cross-attention over memory, feed-forward) -> [final norm] -> tied head -> logits (B, T, V)

The source and target share one token matrix, which is also the output projection (the paper's
§3.4 tying). Padding is masked on both sides: the encoder and the cross-attention never read a
source pad, and the decoder's self-attention never reads a target pad. Positions count real
tokens only, so left and right padding give the same logits for real tokens.

Each side is a :class:`~tformer.models.stack.TransformerStack` (embeddings, blocks built from the
mixer registry, final norm); the two share one ``tok_emb`` module. Each decoder block is given a
:class:`~tformer.mixers.attention.CrossAttention`. Decoding keeps a per-request
:class:`Seq2SeqState`: the encoder runs once, each decoder layer's cross-attention keys/values are
projected from the memory once (its ``new_state``), and the decoder's
:class:`~tformer.models.state.InferenceState` holds each layer's mixer state (attention: a KV
cache of the target prefix).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn

from tformer.ops.masks import padding_mask
from tformer.mixers.attention import CrossAttention, CrossMemory
from tformer.config import TransformerConfig
from tformer.errors import ConfigError
from tformer.models.state import InferenceState
from tformer.models.loss import token_loss
from tformer.models.stack import TransformerStack

Tensor = torch.Tensor


class ScaledEmbedding(nn.Embedding):
    """A token embedding whose lookups are multiplied by ``scale`` (sqrt(d) in Vaswani et al. §3.4);
    the tied output projection reads the unscaled matrix."""

    def __init__(self, num: int, dim: int, scale: float = 1.0):
        super().__init__(num, dim)
        self.scale = scale

    def forward(self, ids: Tensor) -> Tensor:
        out = super().forward(ids)
        return out * self.scale if self.scale != 1.0 else out


@dataclasses.dataclass
class Seq2SeqState:
    """One request's decoding state.

    Attributes:
        cross: the cross-attention keys/values of every decoder layer, projected from the memory once.
        decoder: the decoder's :class:`InferenceState` (each layer's mixer state; ``length`` = target tokens).
        src_mask: ``(B, S)`` 1 = real source token, or ``None``.
    """

    cross: CrossMemory
    decoder: InferenceState
    src_mask: Tensor | None

    @property
    def length(self) -> int:
        return self.decoder.length

    def repeat(self, k: int) -> "Seq2SeqState":
        """Each sequence ``k`` times in a row (beam search: the beams of one source are adjacent)."""
        rep = lambda t: t.repeat_interleave(k, dim=0)                                       # noqa: E731
        cross = CrossMemory(kv=[(rep(a), rep(b)) for a, b in self.cross.kv])
        return Seq2SeqState(cross, self.decoder.map(rep), None if self.src_mask is None else rep(self.src_mask))

    def reorder(self, index: Tensor, rows: Tensor | None = None) -> None:
        """Copy row ``index[i]`` into row ``rows[i]`` (default: every row ``i``), in place in the
        existing buffers (beam search). ``index`` stays within each source's rows, so the
        cross-attention keys/values need no reordering."""
        if rows is None:
            pick = lambda t: t.copy_(t.index_select(0, index))                              # noqa: E731
        else:
            pick = lambda t: t.index_copy_(0, rows, t.index_select(0, index))               # noqa: E731
        self.decoder = self.decoder.map(pick)

    @property
    def nbytes(self) -> int:
        return self.decoder.nbytes + sum(a.nbytes + b.nbytes for a, b in self.cross.kv)


class EncoderDecoder(nn.Module):
    """The encoder-decoder transformer.

    Args:
        config: every switch; ``n_layers`` decoder blocks, ``encoder_layers`` encoder blocks (default
            ``n_layers``), ``embedding_scale`` for the sqrt(d) factor, ``embedding_norm`` for a norm
            after each side's embedding (BART), ``mixer`` for both sides' token mixers. ``causal``
            must be True (it describes the decoder).
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
        enc = dataclasses.replace(c, causal=False, n_layers=c.encoder_layers or c.n_layers, model="encoder",
                                  d_ff=c.encoder_d_ff or c.d_ff, encoder_d_ff=None)
        self.encoder = TransformerStack(enc)
        self.decoder = TransformerStack(c, cross_attention=lambda layer: CrossAttention(c, layer))
        for side in (self.encoder, self.decoder):
            side.init_weights()
        self.encoder.tok_emb = self.decoder.tok_emb = ScaledEmbedding(c.vocab_size, c.d_model,
                                                                       math.sqrt(c.d_model) if c.embedding_scale else 1.0)
        nn.init.normal_(self.encoder.tok_emb.weight, std=c.init_std)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        self.lm_head.weight = self.encoder.tok_emb.weight                       # one matrix: source, target, output
        self.register_buffer("logits_bias", torch.zeros(c.vocab_size))

    def encode(self, src: Tensor, src_mask: Tensor | None = None) -> Tensor:
        """Source ids ``(B, S)`` (``src_mask`` 1 = token, 0 = pad) -> memory ``(B, S, C)``."""
        return self.encoder.final_norm(self.encoder.hidden_states(src, attention_mask=src_mask))

    def decode(self, tgt: Tensor, memory: Tensor | None = None, *, src_mask: Tensor | None = None,
               tgt_mask: Tensor | None = None, state: Seq2SeqState | None = None) -> Tensor:
        """Target ids ``(B, T)`` -> logits ``(B, T, V)``, reading ``memory`` (training, recomputation)
        or the cached ``state`` (decoding; it advances by ``T``)."""
        if state is not None:
            cross, src_mask, dec_state = state.cross, state.src_mask, state.decoder
        else:
            cross, dec_state = CrossMemory(memory=memory), None
        x = self.decoder.hidden_states(tgt, attention_mask=tgt_mask, state=dec_state, context=cross,
                                       context_mask=padding_mask(src_mask) if src_mask is not None else None)
        return self.lm_head(self.decoder.final_norm(x)) + self.logits_bias                 # (B, T, V)

    def forward(self, src: Tensor, tgt: Tensor, targets: Tensor | None = None, *, src_mask: Tensor | None = None,
                tgt_mask: Tensor | None = None, label_smoothing: float = 0.0) -> tuple[Tensor, Tensor | None]:
        """Teacher-forced logits ``(B, T, V)`` for decoder inputs ``tgt``, and the label-smoothed
        cross-entropy against ``targets`` (``-100`` = ignore) if given:
        ``(1 - ε) · (-log p_y) + ε · mean_v(-log p_v)`` (Szegedy et al.; Vaswani et al. use ε = 0.1)."""
        logits = self.decode(tgt, self.encode(src, src_mask), src_mask=src_mask, tgt_mask=tgt_mask)
        loss = None
        if targets is not None:
            loss = token_loss(logits, targets, label_smoothing)
        return logits, loss

    @torch.no_grad()
    def new_state(self, src: Tensor, src_mask: Tensor | None = None, max_len: int = 128) -> Seq2SeqState:
        """Encode ``src`` once and make the decoding state: cross-attention keys/values per decoder
        layer, and the decoder's inference state for ``max_len`` target tokens."""
        memory = self.encode(src, src_mask)
        kv = [block.cross_attn.new_state(memory) for block in self.decoder.blocks]
        return Seq2SeqState(CrossMemory(kv=kv), self.decoder.new_state(src.shape[0], max_len), src_mask)

    def decode_step(self, tokens: Tensor, state: Seq2SeqState) -> Tensor:
        """Logits ``(B, T, V)`` for the next ``tokens (B, T)``, advancing ``state``."""
        return self.decode(tokens, state=state)

    @torch.no_grad()
    def cross_attention_maps(self, src: Tensor, tgt: Tensor, src_mask: Tensor | None = None) -> list[Tensor]:
        """Cross-attention weights of every decoder layer, ``n_layers x (B, n_heads, T, S)``."""
        attns = [block.cross_attn for block in self.decoder.blocks]
        for a in attns:
            a.keep_weights = True
        try:
            self.decode(tgt, self.encode(src, src_mask), src_mask=src_mask)
            return [a.last_weights for a in attns]
        finally:
            for a in attns:
                a.keep_weights, a.last_weights = False, None

    def num_parameters(self, trainable_only: bool = False) -> int:
        """Distinct parameters (the shared matrix counts once)."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)
