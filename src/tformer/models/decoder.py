"""Decoder-only language model (GPT / Llama family): predict token t+1 from tokens <= t.

    ids (B, T) -> token embedding (+ learned/sinusoidal positions) -> n_layers x Block
        -> final norm -> LM head -> logits (B, T, vocab)

Which GPT or Llama it is comes entirely from the :class:`TransformerConfig`.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from tformer.attention.masks import padding_mask
from tformer.config import TransformerConfig
from tformer.layers import Block, make_norm
from tformer.models.embedding import check_ids, init_weights, position_table
from tformer.positions import RotaryEmbedding

Tensor = torch.Tensor


class DecoderLM(nn.Module):
    """A causal language model.

    Args:
        config: every architectural switch. ``config.causal`` must be True.
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        if not config.causal:
            raise ValueError("DecoderLM needs causal=True; use an encoder model for bidirectional attention.")
        if config.type_vocab_size:
            raise ValueError(f"DecoderLM has no token-type embeddings; set type_vocab_size=0 "
                             f"(got {config.type_vocab_size}) or use EncoderModel.")
        self.config = c = config
        self.tok_emb = nn.Embedding(c.vocab_size, c.d_model)
        self.pos_emb = position_table(c)                                        # learned / sinusoidal, or None
        rope = RotaryEmbedding(c.head_dim, c.context_length, c.rope_base) if c.positions == "rope" else None
        self.emb_norm = make_norm(c) if c.embedding_norm else None  # BLOOM's word_embeddings_layernorm
        self.drop = nn.Dropout(c.dropout)
        from tformer.layers import _MixerBlock  # TEMPORARY shim until main's seam
        self.blocks = nn.ModuleList(Block(c, rope=rope) if m == "attention" else _MixerBlock(c, i)
                                    for i, m in enumerate(c.layer_mixers()))
        # Post-norm blocks end in a norm already; pre-norm stacks need one before the head.
        self.final_norm = make_norm(c) if c.norm_placement == "pre" else nn.Identity()
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        if c.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight  # one matrix reads and writes tokens (Press & Wolf)
        self.apply(lambda m: init_weights(m, c.init_std))
        # GPT-2: scale the projections that write into the residual stream by 1/sqrt(2 * n_layers),
        # so the stream's variance does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith(("out_proj.weight", "ffn.down.weight")):
                nn.init.normal_(p, mean=0.0, std=c.init_std / math.sqrt(2 * c.n_layers))

    def forward(
        self,
        ids: Tensor,
        targets: Tensor | None = None,
        *,
        attention_mask: Tensor | None = None,
        positions: Tensor | None = None,
        start_pos: int = 0,
        last_only: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Next-token logits, and the mean cross-entropy if ``targets`` are given.

        Args:
            ids: ``(B, T)`` token ids.
            targets: ``(B, T)`` next-token ids; ``-100`` marks positions to ignore.
            attention_mask: ``(B, m)`` 1 for real tokens, 0 for padding, over every key
                (``m = start_pos + T`` with a KV cache).
            positions: ``(T,)`` or ``(B, T)`` absolute positions. Default: with an ``attention_mask``,
                each token's count of real tokens before it (so left padding shifts nothing);
                otherwise ``start_pos + arange(T)``.
            start_pos: tokens already in the KV cache (set up by the inference module).
            last_only: compute logits for the last position only, ``(B, 1, vocab)`` (generation:
                skips the LM head over the rest of the prompt).
        Returns:
            ``(logits (B, T, vocab), loss or None)``.
        Raises:
            ValueError: for ids of the wrong shape or outside the vocabulary, or positions past
                the context of a learned/sinusoidal table.
        """
        T = ids.shape[1]
        if positions is None and attention_mask is not None:
            positions = (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)[:, -T:]     # (B, T)
        elif positions is None:
            positions = torch.arange(start_pos, start_pos + T, device=ids.device)          # (T,)
        x = self.embed(ids, positions)
        mask = padding_mask(attention_mask) if attention_mask is not None else None
        for block in self.blocks:
            x = block(x, mask=mask, positions=positions, start_pos=start_pos)
        if last_only:
            x = x[:, -1:]
        logits = self.lm_head(self.final_norm(x))                               # (B, T, vocab)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
        return logits, loss

    def embed(self, ids: Tensor, positions: Tensor | None = None, start_pos: int = 0) -> Tensor:
        """Token (+ absolute position) embeddings: ``(B, T)`` ids -> ``(B, T, C)``."""
        check_ids(ids, self.config.vocab_size)
        x = self.tok_emb(ids)                                                    # (B, T, C)
        if self.pos_emb is not None:
            if positions is None:
                positions = torch.arange(start_pos, start_pos + ids.shape[1], device=ids.device)
            x = x + self.pos_emb(positions)
        if self.emb_norm is not None:
            x = self.emb_norm(x)
        return self.drop(x)

    @torch.no_grad()
    def attention_maps(self, ids: Tensor, attention_mask: Tensor | None = None) -> list[Tensor]:
        """Self-attention weights of every layer, ``n_layers x (B, n_heads, T, T)``, from the math backend.

        What they show is where each head reads from; not, by themselves, why the model predicts
        what it does (values and later layers transform what is read).
        """
        x = self.embed(ids)
        mask = padding_mask(attention_mask) if attention_mask is not None else None
        positions = torch.arange(ids.shape[1], device=ids.device)
        maps = []
        for block in self.blocks:
            x, w = block(x, mask=mask, positions=positions, return_weights=True)
            maps.append(w)
        return maps

    def generate(self, ids: Tensor, max_new_tokens: int, **kwargs) -> Tensor:
        """Continue ``ids``; see :func:`tformer.inference.generate.generate` for the options."""
        from tformer.inference.generate import generate

        return generate(self, ids, max_new_tokens, **kwargs)

    def num_parameters(self, trainable_only: bool = False) -> int:
        """Distinct parameters (a tied head counts once)."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)
