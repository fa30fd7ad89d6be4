"""Encoder-only model (BERT family): every token sees every other (non-padding) token.

    ids (B, T) -> token + position (+ token-type) embedding -> [embedding norm] -> n_layers x Block
        -> hidden states (B, T, C)
        -> optional heads: masked-LM logits (tied), mean / CLS pooling, L2-normalised sentence embeddings

It reuses the decoder's :class:`~tformer.layers.Block`; the only differences are ``causal=False``
(bidirectional attention, a padding mask instead of a causal one) and, for BERT,
``norm_placement="post"`` plus ``embedding_norm=True``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tformer.attention.masks import padding_mask
from tformer.config import TransformerConfig
from tformer.layers import _ACTIVATIONS, Block, make_norm
from tformer.models.embedding import check_ids, init_weights, position_table
from tformer.positions import RotaryEmbedding

Tensor = torch.Tensor

POOLINGS = ("mean", "cls")


class MaskedLMHead(nn.Module):
    """BERT's MLM head: dense -> activation -> norm, then the tied token matrix plus a bias.

    Args:
        config: the encoder's config (d_model, activation, norm).
        embedding: the token embedding whose matrix is the output projection.
    """

    def __init__(self, config: TransformerConfig, embedding: nn.Embedding):
        super().__init__()
        self.dense = nn.Linear(config.d_model, config.d_model)
        self.act = _ACTIVATIONS[config.activation]
        self.norm = make_norm(config)
        self.embedding = embedding
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, hidden: Tensor) -> Tensor:
        """``(B, T, C)`` hidden states -> ``(B, T, vocab)`` logits."""
        h = self.norm(self.act(self.dense(hidden)))
        return F.linear(h, self.embedding.weight, self.bias)


class EncoderModel(nn.Module):
    """A bidirectional transformer encoder.

    Args:
        config: every architectural switch; ``config.causal`` must be False.
        mlm_head: add a tied masked-LM head (:meth:`mlm_logits`).
        pooler: add BERT's pooler, ``tanh(Linear(h_[CLS]))`` (``pooling="pooler"`` in :meth:`encode`).
    Raises:
        ValueError: if ``config.causal`` is True.
    """

    def __init__(self, config: TransformerConfig, mlm_head: bool = False, pooler: bool = False):
        super().__init__()
        if config.causal:
            raise ValueError("EncoderModel needs causal=False; use DecoderLM for causal language modelling.")
        self.config = c = config
        self.tok_emb = nn.Embedding(c.vocab_size, c.d_model)
        self.pos_emb = position_table(c)                                        # learned / sinusoidal, or None
        self.type_emb = nn.Embedding(c.type_vocab_size, c.d_model) if c.type_vocab_size else None
        self.emb_norm = make_norm(c) if c.embedding_norm else None
        self.drop = nn.Dropout(c.dropout)
        rope = RotaryEmbedding(c.head_dim, c.context_length, c.rope_base) if c.positions == "rope" else None
        self.blocks = nn.ModuleList(Block(c, rope=rope) for _ in range(c.n_layers))
        # Post-norm blocks end in a norm already; pre-norm stacks need one at the end.
        self.final_norm = make_norm(c) if c.norm_placement == "pre" else nn.Identity()
        self.mlm_head = MaskedLMHead(c, self.tok_emb) if mlm_head else None
        self.pooler = nn.Linear(c.d_model, c.d_model) if pooler else None
        self.apply(lambda m: init_weights(m, c.init_std))

    def forward(
        self,
        ids: Tensor,
        *,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        positions: Tensor | None = None,
    ) -> Tensor:
        """Contextual hidden states.

        Args:
            ids: ``(B, T)`` token ids.
            attention_mask: ``(B, T)`` 1 for real tokens, 0 for padding (padding is never attended to).
            token_type_ids: ``(B, T)`` segment ids in ``[0, type_vocab_size)``; default all 0.
            positions: ``(T,)`` or ``(B, T)`` absolute positions; default ``arange(T)``.
        Returns:
            ``(B, T, C)`` hidden states (rows at padding positions are defined but meaningless).
        Raises:
            ValueError: for ids of the wrong shape or outside the vocabulary, or bad token types.
        """
        x = self.embed(ids, token_type_ids=token_type_ids, positions=positions)
        mask = None
        if attention_mask is not None and not bool(attention_mask.all()):  # a mask hiding nothing is dropped:
            mask = padding_mask(attention_mask)                               # attention runs unmasked, faster
        if positions is None and self.config.positions == "rope":
            positions = torch.arange(ids.shape[1], device=ids.device)
        for block in self.blocks:
            x = block(x, mask=mask, positions=positions)
        return self.final_norm(x)

    def embed(self, ids: Tensor, *, token_type_ids: Tensor | None = None,
              positions: Tensor | None = None) -> Tensor:
        """Token + position (+ token type) embeddings, normalised if ``embedding_norm``: ``(B, T)`` -> ``(B, T, C)``."""
        c = self.config
        check_ids(ids, c.vocab_size)
        x = self.tok_emb(ids)                                                    # (B, T, C)
        if self.pos_emb is not None:
            if positions is None:
                positions = torch.arange(ids.shape[1], device=ids.device)
            x = x + self.pos_emb(positions)
        if self.type_emb is not None:
            if token_type_ids is None:
                x = x + self.type_emb.weight[0]                                  # every token is segment 0
            else:
                if token_type_ids.shape != ids.shape:
                    raise ValueError(f"token_type_ids {tuple(token_type_ids.shape)} must have the shape of "
                                     f"ids {tuple(ids.shape)}.")
                if token_type_ids.numel() and int(token_type_ids.max()) >= c.type_vocab_size:
                    raise ValueError(f"token_type_ids must be < type_vocab_size={c.type_vocab_size}.")
                x = x + self.type_emb(token_type_ids)
        elif token_type_ids is not None:
            raise ValueError("token_type_ids given but the model has type_vocab_size=0; drop them "
                             "or build the model with type_vocab_size > 0.")
        if self.emb_norm is not None:
            x = self.emb_norm(x)
        return self.drop(x)

    def mlm_logits(self, ids: Tensor, **kwargs) -> Tensor:
        """Masked-LM logits ``(B, T, vocab)``; keyword arguments as :meth:`forward`.

        Raises:
            ValueError: if the model was built without ``mlm_head=True``.
        """
        if self.mlm_head is None:
            raise ValueError("this EncoderModel has no masked-LM head; build it with mlm_head=True.")
        return self.mlm_head(self(ids, **kwargs))

    def encode(self, ids: Tensor, attention_mask: Tensor | None = None, *, token_type_ids: Tensor | None = None,
               pooling: str = "mean", normalize: bool = True) -> Tensor:
        """Sentence embeddings ``(B, C)``: pooled hidden states, L2-normalised if ``normalize``
        (then a dot product is the cosine similarity).

        Args:
            pooling: ``mean`` or ``cls`` (see :func:`pool`), or ``pooler`` (BERT's tanh pooler on [CLS]).
        """
        hidden = self(ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        if pooling == "pooler":
            if self.pooler is None:
                raise ValueError("pooling='pooler' needs a model built with pooler=True (BERT's pooler weights).")
            pooled = torch.tanh(self.pooler(hidden[:, 0]))
        else:
            pooled = pool(hidden, attention_mask, pooling)
        return F.normalize(pooled, p=2, dim=-1) if normalize else pooled

    def num_parameters(self) -> int:
        """Distinct parameters (the tied MLM matrix counts once)."""
        return sum(p.numel() for p in self.parameters())


def pool(hidden: Tensor, attention_mask: Tensor | None = None, mode: str = "mean") -> Tensor:
    """Collapse ``(B, T, C)`` hidden states to ``(B, C)``.

    Args:
        hidden: ``(B, T, C)``.
        attention_mask: ``(B, T)`` 1 = token, 0 = padding; padding never enters the mean.
        mode: ``mean`` (average over real tokens, sentence-transformers' default) or ``cls``
            (the first token's state).
    Returns:
        ``(B, C)``.
    """
    if mode not in POOLINGS:
        raise ValueError(f"pooling={mode!r} is not known; choose one of {', '.join(POOLINGS)}.")
    if mode == "cls":
        return hidden[:, 0]
    if attention_mask is None:
        return hidden.mean(dim=1)
    m = attention_mask.to(hidden.dtype).unsqueeze(-1)                           # (B, T, 1)
    return (hidden * m).sum(dim=1) / m.sum(dim=1).clamp(min=1e-9)
