"""Encoder-only model (BERT family): every token sees every other (non-padding) token.

    ids (B, T) -> token + position (+ token-type) embedding -> [embedding norm] -> n_layers x Block
        -> hidden states (B, T, C)
        -> optional heads: masked-LM logits (tied), mean / CLS pooling, L2-normalised sentence embeddings

It shares the decoder's :class:`~tformer.models.stack.TransformerStack`; the only differences are ``causal=False``
(bidirectional attention, a padding mask instead of a causal one) and, for BERT,
``norm_placement="post"`` plus ``embedding_norm=True``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tformer.config import TransformerConfig
from tformer.errors import ConfigError, InputError
from tformer.nn.feed_forward import ACTIVATIONS
from tformer.nn.norms import make_norm
from tformer.models.stack import TransformerStack

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
        self.act = ACTIVATIONS[config.activation]
        self.norm = make_norm(config)
        self.embedding = embedding
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, hidden: Tensor) -> Tensor:
        """``(B, T, C)`` hidden states -> ``(B, T, vocab)`` logits."""
        h = self.norm(self.act(self.dense(hidden)))
        return F.linear(h, self.embedding.weight, self.bias)


class EncoderModel(TransformerStack):
    """A bidirectional transformer encoder.

    Args:
        config: every architectural switch; ``config.causal`` must be False.
        mlm_head: add a tied masked-LM head (:meth:`mlm_logits`).
        pooler: add BERT's pooler, ``tanh(Linear(h_[CLS]))`` (``pooling="pooler"`` in :meth:`encode`).
    Raises:
        ConfigError: if ``config.causal`` is True.
    """

    positions_follow_mask = False   # BERT counts positions from 0 whatever the padding

    def __init__(self, config: TransformerConfig, mlm_head: bool = False, pooler: bool = False):
        if config.causal:
            raise ConfigError("EncoderModel needs causal=False; use DecoderLM for causal language modelling.")
        super().__init__(config)
        c = config
        self.mlm_head = MaskedLMHead(c, self.tok_emb) if mlm_head else None
        self.pooler = nn.Linear(c.d_model, c.d_model) if pooler else None
        self.init_weights(scale_residual=False)

    @staticmethod
    def options_from_state(state: dict) -> dict:
        """The optional heads a state dict carries weights for."""
        return {"mlm_head": "mlm_head.bias" in state, "pooler": "pooler.weight" in state}

    def forward(
        self,
        ids: Tensor,
        *,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        positions: Tensor | None = None,
        global_attention_mask: Tensor | None = None,
    ) -> Tensor:
        """Contextual hidden states.

        Args:
            ids: ``(B, T)`` token ids.
            attention_mask: ``(B, T)`` 1 for real tokens, 0 for padding (padding is never attended to).
            token_type_ids: ``(B, T)`` segment ids in ``[0, type_vocab_size)``; default all 0.
            positions: ``(T,)`` or ``(B, T)`` absolute positions; default ``arange(T)``.
            global_attention_mask: ``(B, T)`` 1 for tokens with global attention (Longformer
                layers only, as HF's argument of that name; default: none beyond the config's
                ``global_positions``).
        Returns:
            ``(B, T, C)`` hidden states (rows at padding positions are defined but meaningless).
        Raises:
            InputError: for ids of the wrong shape or outside the vocabulary, or bad token types.
        """
        if attention_mask is not None and bool(attention_mask.all()):  # a mask hiding nothing is dropped:
            attention_mask = None                                         # attention runs unmasked, faster
        if global_attention_mask is not None and "longformer" not in self.config.layer_mixers():
            raise InputError(f"global_attention_mask applies to Longformer layers; this encoder's mixers are "
                             f"{sorted(set(self.config.layer_mixers()))}; leave it out.")
        x = self.hidden_states(ids, attention_mask=attention_mask, positions=positions,
                               token_type_ids=token_type_ids, global_attention_mask=global_attention_mask)
        return self.final_norm(x)

    def mlm_logits(self, ids: Tensor, **kwargs) -> Tensor:
        """Masked-LM logits ``(B, T, vocab)``; keyword arguments as :meth:`forward`.

        Raises:
            InputError: if the model was built without ``mlm_head=True``.
        """
        if self.mlm_head is None:
            raise InputError("this EncoderModel has no masked-LM head; build it with mlm_head=True.")
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
                raise InputError("pooling='pooler' needs a model built with pooler=True (BERT's pooler weights).")
            pooled = torch.tanh(self.pooler(hidden[:, 0]))
        else:
            pooled = pool(hidden, attention_mask, pooling)
        return F.normalize(pooled, p=2, dim=-1) if normalize else pooled


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
        raise InputError(f"pooling={mode!r} is not known; choose one of {', '.join(POOLINGS)}.")
    if mode == "cls":
        return hidden[:, 0]
    if attention_mask is None:
        return hidden.mean(dim=1)
    m = attention_mask.to(hidden.dtype).unsqueeze(-1)                           # (B, T, 1)
    return (hidden * m).sum(dim=1) / m.sum(dim=1).clamp(min=1e-9)
