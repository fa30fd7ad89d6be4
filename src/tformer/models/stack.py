"""What every transformer family shares: the embeddings in, the stack of blocks, the final norm,
and the per-request inference state.

    ids (B, T) -> token embedding (+ learned/sinusoidal positions) (+ token types) -> [norm] -> dropout
        -> n_layers x Block(mixer, feed-forward) -> final norm -> hidden (B, T, C)

The decoder (``DecoderLM``) and the encoder (``EncoderModel``) subclass :class:`TransformerStack`
and add their heads. This is the one place where default positions are derived: from the state's
length (cached decoding), from the attention mask (left padding shifts nothing), or ``arange(T)``.
Parameters keep the names they always had (``tok_emb``, ``pos_emb``, ``type_emb``, ``emb_norm``,
``blocks.i``, ``final_norm``), so checkpoints and the HF converters read them unchanged.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from tformer.ops.dropout import dropout as cpu_dropout
from tformer.ops.masks import padding_mask
from tformer.config import TransformerConfig
from tformer.errors import InputError
from tformer.machine import release_free_heap
from tformer.models.state import InferenceState
from tformer.models.block import Block
from tformer.nn.norms import make_norm
from tformer.mixers import check_config as check_mixers
from tformer.mixers.base import Shared, Step
from tformer.nn.markers import writes_residual
from tformer.nn.embedding import check_ids, init_weights, position_table
from tformer.nn.positions import RotaryEmbedding, table_length

Tensor = torch.Tensor


class TransformerStack(nn.Module):
    """Embeddings, ``n_layers`` blocks and the final norm, built from one config.

    Args:
        config: every architectural switch.
        cross_attention: a factory ``layer -> module`` giving every block its cross-attention
            sub-layer (encoder-decoder decoders: ``lambda i: CrossAttention(config, i)``), or ``None``.
    """

    # Decoders derive default positions from the attention mask (left padding); encoders count
    # from 0 whatever the padding (BERT's convention, with right padding the two agree).
    positions_follow_mask = True

    def __init__(self, config: TransformerConfig, cross_attention: Callable[[int], nn.Module] | None = None):
        super().__init__()
        check_mixers(config)                                                    # names -> classes, and their refusals
        self.config = c = config
        self.tok_emb = nn.Embedding(c.vocab_size, c.d_model)
        self.pos_emb = position_table(c)                                        # learned / sinusoidal, or None
        self.type_emb = nn.Embedding(c.type_vocab_size, c.d_model) if c.type_vocab_size else None
        self.emb_norm = make_norm(c) if c.embedding_norm else None             # BERT, BLOOM
        # Gemma's sqrt(d) on the decoder's lookups, here and not in tok_emb, which quantisation may replace
        # (an encoder-decoder scales in its shared ScaledEmbedding)
        self.embed_scale = math.sqrt(c.d_model) if c.embedding_scale and c.model == "decoder" else 1.0
        rope = RotaryEmbedding(c.head_dim, c.context_length, c.rope_base, c.rope_scaling) if c.positions == "rope" else None
        # the sliding-window layers' own base (Gemma 3: 10,000 beside the global layers' 1,000,000), unscaled
        local = RotaryEmbedding(c.head_dim, c.context_length, c.rope_local_base) if c.rope_local_base else None
        shared = Shared(rope=rope, local_rope=local)
        self.blocks = nn.ModuleList(Block(c, i, shared, cross_attention=cross_attention(i) if cross_attention else None)
                                    for i in range(c.n_layers))
        # Post-norm blocks end in a norm already; pre-norm stacks need one at the end.
        self.final_norm = make_norm(c) if c.norm_placement == "pre" else nn.Identity()
        self.rope, self.local_rope = rope, local
        # tformer.interp's hook function while it runs a model (see Step.hooks); None otherwise.
        self.hooks: Callable[[str, Tensor], Tensor] | None = None
        # Activation checkpointing (training/checkpointing.py sets it): keep each block's input only, run the
        # block again in the backward. Off by default. trim_heap: hand the heap's free pages back before each
        # checkpointed block runs (forward and recomputation), so one block's freed pages are not all kept.
        self.checkpointing = False
        self.trim_heap = False

    def init_weights(self, scale_residual: bool = True) -> None:
        """GPT-2's init: N(0, init_std) everywhere (then a mixer's own ``init_weights()``, if it has one), and (``scale_residual``) the projections that write
        into the residual stream, marked by their mixer or feed-forward, scaled by 1/sqrt(2·n_layers)
        so the stream's variance does not grow with depth. BERT's init (the encoder) does not scale."""
        c = self.config
        self.apply(lambda m: init_weights(m, c.init_std))
        for block in self.blocks:  # a mixer with an initialisation of its own (Mamba's) applies it over that
            if hasattr(block.attn, "init_weights"):
                block.attn.init_weights()
        for m in self.modules() if scale_residual else ():
            if writes_residual(m):
                nn.init.normal_(m.weight, mean=0.0, std=c.init_std / math.sqrt(2 * c.n_layers))
        if c.zero_init_residual:                   # each block starts as the identity (modded-nanogpt)
            for m in self.modules():
                if writes_residual(m):
                    nn.init.zeros_(m.weight)

    # ------------------------------------------------------------------ state
    def new_state(self, batch_size: int, max_len: int, dtype: torch.dtype | None = None, *,
                  static: bool = False) -> InferenceState:
        """A fresh per-request inference state: every layer's mixer state for ``batch_size``
        sequences of up to ``max_len`` tokens, in ``dtype`` (default: the embedding's).

        ``static=True`` builds each mixer's static-decoding state (its ``new_static_state``, else its
        ``new_state``): a one-token call on it is then the static decode step (see :meth:`hidden_states`).
        """
        if batch_size < 1 or max_len < 1:
            raise InputError(f"an inference state needs batch_size >= 1 and max_len >= 1, got {batch_size}, {max_len}.")
        ref = self.tok_emb.weight
        dtype = dtype or ref.dtype

        def layer_state(mixer):
            make = getattr(mixer, "new_static_state", None) if static else None
            make = make or getattr(mixer, "new_state", None)
            return make(batch_size, max_len, dtype, ref.device) if make is not None else None

        layers = [layer_state(b.attn) for b in self.blocks]
        return InferenceState(layers, batch_size, max_len, ref.device, static=static)

    # ------------------------------------------------------------------ embeddings
    def default_positions(self, T: int, start_pos: int, attention_mask: Tensor | None) -> Tensor:
        """Positions of ``T`` new tokens after ``start_pos`` held ones: ``(B, T)`` from the mask
        (each token's count of real tokens before it) or ``(T,)`` ``start_pos + arange(T)``."""
        if attention_mask is not None and self.positions_follow_mask:
            return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)[:, -T:]    # (B, T)
        return torch.arange(start_pos, start_pos + T, device=self.tok_emb.weight.device)  # (T,)

    def embed(self, ids: Tensor, positions: Tensor | None = None, token_type_ids: Tensor | None = None) -> Tensor:
        """Token (+ absolute position) (+ token type) embeddings, normalised if ``embedding_norm``:
        ``(B, T)`` ids -> ``(B, T, C)`` (dropout is applied by the caller, which knows the mode)."""
        if ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
            raise InputError(f"ids must be a (batch, seq_len) integer tensor, got {ids.dtype} {tuple(ids.shape)}.")
        if positions is None and self.pos_emb is not None:
            positions = torch.arange(ids.shape[1], device=ids.device)
        try:  # an index outside a table raises here; look at the values only then (no sync otherwise)
            x = self.tok_emb(ids)                                                # (B, T, C)
            if self.embed_scale != 1.0:
                x = x * self.embed_scale                                         # embedding_scale (Gemma)
            hook = self.hooks
            if hook is not None:
                x = hook("hook_embed", x)
            if self.pos_emb is not None:
                pe = self.pos_emb(positions)                                     # (T, C) or (B, T, C)
                x = x + (pe if hook is None else hook("hook_pos_embed", pe.expand_as(x)))
            x = self._add_token_types(x, ids, token_type_ids)
        except IndexError:
            self._explain_index_error(ids, positions, token_type_ids)
            raise
        return self.emb_norm(x) if self.emb_norm is not None else x

    def _add_token_types(self, x: Tensor, ids: Tensor, token_type_ids: Tensor | None) -> Tensor:
        if self.type_emb is None:
            if token_type_ids is not None:
                raise InputError("token_type_ids given but the model has type_vocab_size=0; drop them "
                                 "or build the model with type_vocab_size > 0.")
            return x
        if token_type_ids is None:
            return x + self.type_emb.weight[0]                                   # every token is segment 0
        if token_type_ids.shape != ids.shape:
            raise InputError(f"token_type_ids {tuple(token_type_ids.shape)} must have the shape of "
                             f"ids {tuple(ids.shape)}.")
        return x + self.type_emb(token_type_ids)

    def _explain_index_error(self, ids: Tensor, positions: Tensor | None, token_type_ids: Tensor | None) -> None:
        """After a lookup failed: find which input was out of range and say so (values read only here)."""
        c = self.config
        check_ids(ids, c.vocab_size)
        if token_type_ids is not None and int(token_type_ids.max()) >= c.type_vocab_size:
            raise InputError(f"token_type_ids must be < type_vocab_size={c.type_vocab_size}.")
        if positions is not None and self.pos_emb is not None:
            self._ensure_positions(int(positions.max()) + 1)

    # ------------------------------------------------------------------ the stack
    def hidden_states(
        self,
        ids: Tensor,
        *,
        attention_mask: Tensor | None = None,
        positions: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        state: InferenceState | None = None,
        return_weights: bool = False,
        context: Tensor | None = None,
        context_mask: Tensor | None = None,
        global_attention_mask: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, list]:
        """Run embeddings and blocks: ``(B, T)`` ids -> ``(B, T, C)`` hidden states (before the
        final norm), and every layer's attention weights when ``return_weights``.

        Args:
            attention_mask: ``(B, m)`` 1 for real tokens, 0 for padding, over every key
                (``m = state.length + T`` with a state), or, with a state, ``(B, T)`` over the new
                tokens only: the earlier keys are then read from ``state.valid``.
            positions: ``(T,)`` or ``(B, T)`` absolute positions; default :meth:`default_positions`.
            state: the request's inference state (written at ``state.length``, which then advances).
                On a static state (``new_state(..., static=True)``) a call with ``T == 1`` is the
                static decode step: row ``b`` writes at ``state.index[b]`` (which then advances by
                one; ``state.length`` does not: :func:`tformer.generation.step.decode_step` keeps
                it), reads ``state.valid`` as its padding mask and (default) as its position, each
                row's count of real tokens held; ``attention_mask``, if given, says over its last
                column whether the new token is real. Nothing in this path depends on a Python
                value that changes between steps, so ``torch.compile`` captures it once.
            global_attention_mask: ``(B, T)`` 1 for tokens given global attention (Longformer
                layers; HF's argument of that name), 0 for the rest.
        """
        T = ids.shape[1]
        if state is not None and state.static and T == 1:   # never read state.length here: a changing int recompiles
            step = self._static_step(ids, attention_mask, positions, state)
        else:
            step = self._step(T, state.length if state is not None else 0, attention_mask, positions, state)
        # dynamo cannot trace is_inference_mode_enabled() (a graph break per forward): a compiled forward
        # is never in inference mode, so it is asked only outside a compile
        step.dropout = self.training and (torch.compiler.is_compiling() or not torch.is_inference_mode_enabled())
        step.return_weights = return_weights
        step.hooks = self.hooks
        if state is not None and step.tokens is not None:
            state.padded = True                        # the mask may mark padding: say so without reading it
        if global_attention_mask is not None:
            if tuple(global_attention_mask.shape) != tuple(ids.shape):
                raise InputError(f"global_attention_mask has shape {tuple(global_attention_mask.shape)}; it must be "
                                 f"(batch, length) = {tuple(ids.shape)}, like the ids.")
            step.global_tokens = global_attention_mask.bool()
        x = cpu_dropout(self.embed(ids, step.positions, token_type_ids), self.config.dropout, step.dropout)
        weights = []
        recompute = self.checkpointing and self.training and torch.is_grad_enabled() and not return_weights
        for i, block in enumerate(self.blocks):
            layer_state = state.layers[i] if state is not None else None
            if recompute:     # saves x (B, T, C) per block; the block's insides are recomputed in the backward
                x = checkpoint(functools.partial(_after_trim, block) if self.trim_heap else block, x, step,
                               layer_state, context=context, context_mask=context_mask, use_reentrant=False)
            else:
                x = block(x, step, layer_state, context=context, context_mask=context_mask)
            if return_weights:
                x, w = x
                weights.append(w)
        if state is not None:
            if step.write_index is None:
                state.advance(step.start_pos + T)
            else:
                state.index.add_(1)
        return (x, weights) if return_weights else x

    def _step(self, T: int, start: int, attention_mask: Tensor | None, positions: Tensor | None,
              state: InferenceState | None) -> Step:
        """The eager path: Python-int start, padding mask over ``start + T`` keys."""
        end = start + T
        new_only = state is not None and attention_mask is not None and start > 0 and attention_mask.shape[-1] == T
        if positions is None:
            if new_only and self.positions_follow_mask:    # real tokens held + real tokens before, among the new
                held = state.valid[:, :start].sum(-1, keepdim=True)                       # (B, 1)
                positions = (held + attention_mask.long().cumsum(-1) - 1).clamp(min=0)    # (B, T)
            else:
                positions = self.default_positions(T, start, attention_mask)
            self._ensure_positions(end, state)
        elif positions.numel():
            self._ensure_positions(int(positions.max()) + 1, state)    # given ones may leap ahead (one read, per call)
        mask = tokens = None
        if attention_mask is not None:
            tokens = attention_mask[:, -T:].bool()                                # (B, T)
        if state is not None:
            if end > state.max_len:
                raise InputError(f"the inference state holds {state.max_len} positions; cannot add {T} tokens "
                                 f"after {start}. Make the state with a larger max_len.")
            state.valid[:, start:end] = tokens if tokens is not None else True
        if attention_mask is not None:
            mask = padding_mask(state.valid[:, :end] if new_only else attention_mask)     # (B, 1, 1, m)
        return Step(positions=positions, mask=mask, tokens=tokens, start_pos=start)

    def _static_step(self, ids: Tensor, attention_mask: Tensor | None, positions: Tensor | None,
                     state: InferenceState) -> Step:
        """The static decode path: one token per row, written at ``state.index``. The mask, built once
        here for every layer, is the state's real tokens up to and including that index (causality)."""
        index = state.index                                                     # (B,)
        if self.rope is not None and self.rope.longrope is not None:            # the state's set (one int compare)
            self.rope.ensure(state.max_len, state.context)
        if positions is None:                                                   # real tokens held, per row
            positions = state.valid.sum(-1, keepdim=True)                       # (B, 1)
        real = attention_mask[:, -1:].bool() if attention_mask is not None else None   # (B, 1); None: real
        rows = torch.arange(ids.shape[0], device=ids.device)
        state.valid[rows, index] = real[:, 0] if real is not None else True
        keys = torch.arange(state.max_len, device=ids.device)
        mask = state.valid & (keys[None] <= index[:, None])                     # (B, L)
        return Step(positions=positions, mask=mask[:, None, None, :], tokens=real, write_index=index)

    def _ensure_positions(self, length: int, state: InferenceState | None = None) -> None:
        """Check (with Python ints) that positions below ``length`` fit the position table; a LongRoPE
        picks its set for the state's ``context``, else for ``length`` (tformer.nn.rope_scaling)."""
        if self.rope is not None:
            held = state.context if state is not None else None     # LongRoPE: the state's context picks the set
            self.rope.ensure(length, held)
            if self.local_rope is not None:
                self.local_rope.ensure(length, held)
        elif self.pos_emb is not None and length > table_length(self.pos_emb):
            raise InputError(f"position {length - 1} is beyond context_length={table_length(self.pos_emb)} of "
                             f"the {self.config.positions} position table; shorten the input or build the model "
                             f"with a larger context_length.")

    def num_parameters(self, trainable_only: bool = False) -> int:
        """Distinct parameters (a tied head counts once)."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)


def _after_trim(block: nn.Module, *args, **kwargs):
    """``block(*args, **kwargs)`` after :func:`~tformer.machine.release_free_heap` (a checkpointed block with
    ``trim_heap``)."""
    release_free_heap()
    return block(*args, **kwargs)
