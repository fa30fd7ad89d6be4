"""Decoder-only language model (GPT / Llama / Mamba family): predict token t+1 from tokens <= t.

    ids (B, T) -> embeddings -> n_layers x Block(mixer, feed-forward) -> final norm -> LM head
        -> logits (B, T, vocab)

Which GPT, Llama or hybrid it is comes entirely from the :class:`TransformerConfig`; the shared
part (embeddings, blocks, state) is :class:`~tformer.models.stack.TransformerStack`.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tformer.config import TransformerConfig
from tformer.errors import ConfigError, InputError
from tformer.models.state import InferenceState
from tformer.models.loss import token_loss
from tformer.models.stack import TransformerStack
from tformer.nn.softcap import softcap

Tensor = torch.Tensor


class DecoderLM(TransformerStack):
    """A causal language model.

    Args:
        config: every architectural switch. ``config.causal`` must be True.
    """

    def __init__(self, config: TransformerConfig):
        if not config.causal:
            raise ConfigError("DecoderLM needs causal=True; use an encoder model for bidirectional attention.")
        if config.type_vocab_size:
            raise ConfigError(f"DecoderLM has no token-type embeddings; set type_vocab_size=0 "
                              f"(got {config.type_vocab_size}) or use EncoderModel.")
        super().__init__(config)
        c = config
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        if c.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight  # one matrix reads and writes tokens (Press & Wolf)
        self.init_weights()

    def forward(
        self,
        ids: Tensor,
        targets: Tensor | None = None,
        *,
        attention_mask: Tensor | None = None,
        positions: Tensor | None = None,
        state: InferenceState | None = None,
        last_only: bool = False,
        last_index: Tensor | None = None,
        labelled_only: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Next-token logits, and the mean cross-entropy if ``targets`` are given.

        Args:
            ids: ``(B, T)`` token ids.
            targets: ``(B, T)`` next-token ids; ``-100`` marks positions to ignore.
            attention_mask: ``(B, m)`` 1 for real tokens, 0 for padding, over every key
                (``m = state.length + T`` with a state), or, with a state, ``(B, T)`` over the new
                tokens only (the earlier ones are read from ``state.valid``).
            positions: ``(T,)`` or ``(B, T)`` absolute positions. Default: with an ``attention_mask``,
                each token's count of real tokens before it (so left padding shifts nothing);
                otherwise ``state.length + arange(T)``.
            state: a per-request :class:`~tformer.models.state.InferenceState` from
                :meth:`new_state`; the new tokens are written after what it holds (on a static
                state, one token per row is the static decode step: see ``hidden_states``).
            last_only: compute logits for the last position only, ``(B, 1, vocab)`` (generation:
                skips the LM head over the rest of the prompt).
            last_index: ``(B,)`` compute logits at position ``last_index[b]`` of row ``b`` only,
                ``(B, 1, vocab)`` (right-padded prompts, each ending at its own length).
            labelled_only: with ``targets``, run the final norm and LM head only at the positions
                whose target is not ``-100``: logits ``(1, N, vocab)`` for those ``N`` positions, the
                same mean loss (fine-tuning on answers: the head is most of the FLOPs it skips).
        Returns:
            ``(logits (B, T, vocab), loss or None)``.
        Raises:
            InputError: for ids of the wrong shape or outside the vocabulary, positions past the
                context of a learned/sinusoidal table, or ``last_index`` with ``last_only``.
        """
        x = self.hidden_states(ids, attention_mask=attention_mask, positions=positions, state=state)
        if last_index is not None:
            if last_only or last_index.shape != (ids.shape[0],):
                raise InputError(f"last_index must be a ({ids.shape[0]},) tensor of positions, without last_only; "
                                 f"got shape {tuple(last_index.shape)}.")
            x = x[torch.arange(ids.shape[0], device=x.device), last_index][:, None]   # (B, 1, C)
        elif last_only:
            x = x[:, -1:]
        elif labelled_only and targets is not None:
            keep = targets != -100                                              # (B, T)
            x, targets = x[keep][None], targets[keep][None]                     # (1, N, C), (1, N)
        x = self.final_norm(x)
        if self.hooks is not None:
            x = self.hooks("ln_final.hook_out", x)
        logits = self.lm_head(x)                                                # (B, T, vocab)
        logits = softcap(logits, self.config.logit_softcap)                    # identity when 0
        loss = None
        if targets is not None:
            loss = token_loss(logits, targets)
        return logits, loss

    @torch.no_grad()
    def attention_maps(self, ids: Tensor, attention_mask: Tensor | None = None) -> list[Tensor]:
        """Self-attention weights of every layer, ``n_layers x (B, n_heads, T, T)``, from the math backend
        (``None`` for a layer whose mixer has no attention weights).

        What they show is where each head reads from; not, by themselves, why the model predicts
        what it does (values and later layers transform what is read).
        """
        positions = torch.arange(ids.shape[1], device=ids.device)
        _, maps = self.hidden_states(ids, attention_mask=attention_mask, positions=positions, return_weights=True)
        return maps
