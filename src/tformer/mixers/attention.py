"""Multi-head attention: MHA, grouped-query (GQA) and multi-query (MQA); self and cross.

``n_kv_heads`` decides the family: ``n_heads`` is MHA (Vaswani et al.), 1 is MQA (Shazeer, 2019),
anything dividing ``n_heads`` is GQA (Ainslie et al., 2023): each key/value head serves
``n_heads / n_kv_heads`` query heads, which shrinks the K/V projections and the KV cache by
that factor. K and V stay at ``n_kv_heads`` width all the way into the attention kernel.

- :class:`MultiHeadAttention`: self-attention, the ``"attention"`` token mixer (see
  :mod:`tformer.mixers.base`). Its projections, RoPE and parameter count are
  :class:`~tformer.mixers.projected.ProjectedAttention`'s, like every attention mixer's; its
  inference state is a :class:`~tformer.mixers.kv_cache.KVCache`, owned by the caller.
- :class:`CrossAttention`: encoder-decoder attention, queries from the decoder and keys/values
  from the encoder's memory; a decoder block gets one injected
  (``Block(config, layer, shared, cross_attention=CrossAttention(config, layer))``). Its state
  is the memory's keys/values, projected once per request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from tformer.ops.explicit import explicit_attention
from tformer.ops.sdpa import scaled_dot_product_attention
from tformer.config import TransformerConfig
from tformer.errors import InputError
from tformer.mixers.kv_cache import KeyView, KVCache, StaticKVCache
from tformer.mixers.base import Shared, Step
from tformer.mixers.projected import ProjectedAttention, merge_heads, projection_parameters, split_heads
from tformer.nn.markers import mark_residual
from tformer.nn.positions import RotaryEmbedding
from tformer.ops.alibi import alibi_slopes

Tensor = torch.Tensor


class MultiHeadAttention(ProjectedAttention):
    """Self-attention with ``n_heads`` query heads over ``n_kv_heads`` key/value heads.

    Args:
        config: supplies d_model, n_heads, n_kv_heads, head_dim, biases, positions, backend,
            causal, sliding_window and attn_dropout.
        layer: index in the stack (unused: every layer is alike).
        shared: the model's shared objects; its ``rope`` table when ``config.positions == "rope"``.
        rope: the rotary table, when not given through ``shared``.

    Parameters (``qkv_proj``, ``out_proj``) and ``count_parameters`` are the base class's.
    """

    name = "attention"
    SUPPORTS = frozenset({"alibi", "attn_dropout", "sliding_window"})

    def __init__(self, config: TransformerConfig, layer: int = 0, shared: Shared | None = None, *,
                 rope: RotaryEmbedding | None = None):
        super().__init__(config, layer, shared, rope=rope)
        c = config
        self.window = c.sliding_window if c.windowed(layer) else None        # window_layers: some layers only
        self.backend, self.attn_dropout = c.attention_backend, c.attn_dropout
        self.scale, self.softcap = c.attn_scale, c.attn_softcap              # None: 1/sqrt(hs); 0: no soft-cap
        slopes = alibi_slopes(c.n_heads) if c.positions == "alibi" else None
        self.register_buffer("alibi_slopes", slopes, persistent=False)

    # ------------------------------------------------------------------ the mixer protocol
    @classmethod
    def state_bytes(cls, config: TransformerConfig, n_tokens: int, batch_size: int = 1,
                    bytes_per_element: int = 4) -> int:
        """One layer's KV cache: ``2 · n · h_kv · d_head · bytes`` per sequence."""
        return 2 * n_tokens * config.n_kv_heads * config.head_dim * bytes_per_element * batch_size

    @classmethod
    def extra_training_flops_per_token(cls, config: TransformerConfig, seq_len: int, layer: int = 0) -> int:
        """The scores Q·Kᵀ and the weighted sum A·V, which no parameter counts: forward 2·2·T·d_attn
        per token, times 3 with the backward (PaLM, appendix B)."""
        return 12 * seq_len * config.n_heads * config.head_dim

    def new_state(self, batch_size: int, max_len: int, dtype: torch.dtype = torch.float32,
                  device: torch.device | str | None = None) -> KVCache:
        """An eager KV cache (see :mod:`tformer.mixers.kv_cache`)."""
        return KVCache(batch_size, self.n_kv_heads, max_len, self.head_dim, dtype, device)

    def new_static_state(self, batch_size: int, max_len: int, dtype: torch.dtype = torch.float32,
                         device: torch.device | str | None = None) -> StaticKVCache:
        """A KV cache for static decoding: one token per row at a per-row tensor index."""
        return StaticKVCache(batch_size, self.n_kv_heads, max_len, self.head_dim, dtype, device)

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        x: Tensor,
        step: Step | None = None,
        state: KVCache | None = None,
        *,
        mask: Tensor | None = None,
        positions: Tensor | None = None,
        return_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attend from ``x (B, T, C)``.

        Args:
            step: what the model computed for this call (positions, padding mask, start_pos,
                dropout); when ``None`` the keywords below are used (direct use).
            state: this layer's KV cache (anything with ``store(k, v, step) -> KeyView``), or
                ``None`` (attend over ``x`` alone).
            mask: bool key mask broadcastable to ``(B, nh, T, m)``, ``True`` = attend (padding).
            positions: absolute positions of the ``T`` queries, ``(T,)`` or ``(B, T)`` (RoPE);
                default ``arange(T)``.
            return_weights: also return ``(B, nh, T, m)`` attention weights (math backend).
        Returns:
            ``(B, T, C)``, or ``(out, weights)``.
        """
        if step is None:
            if positions is None and self.rope is not None:
                positions = torch.arange(x.shape[1], device=x.device)
            step = Step(positions=positions, mask=mask, dropout=self.training, return_weights=return_weights)
        if step.hooks is not None:
            return self.forward_hooked(x, step, state)
        q, k, v = self.project(x, step)                              # (B, nh, T, hs), (B, nkv, T, hs) x 2

        # The cache decides how the new keys are written and what is read (eager prefix, or a static
        # step's whole buffer with each row's query index); without one, attend over k and v alone.
        keys = state.store(k, v, step) if state is not None else KeyView(k, v, step.mask)
        kw = keys.attention_arguments(causal=self.causal, window=self.window, alibi_slopes=self.alibi_slopes,
                                      backend=self.backend, dtype=q.dtype)
        if self.softcap:       # the cap sits between the scores and the mask: no fused kernel has it
            out, weights = self.capped(q, keys, kw, step)
            return self.finish(out, step, weights)
        # ALiBi goes in as slopes: flash computes -slope * |p_q - p_k| per block, the other
        # backends build the dense (nh, T, m) bias (queries at key positions m - T .. m - 1).
        result = scaled_dot_product_attention(
            q, keys.k, keys.v, dropout_p=self.attn_dropout if step.dropout else 0.0,
            return_weights=step.return_weights, scale=self.scale, **kw)
        out, weights = result if step.return_weights else (result, None)
        return self.finish(out, step, weights)                       # re-assemble heads: (B, T, C)

    def capped(self, q: Tensor, keys: KeyView, kw: dict, step: Step) -> tuple[Tensor, Tensor | None]:
        """Attention with soft-capped scores (Gemma 2), ``softmax(cap · tanh(Q Kᵀ · scale / cap) + mask) V``,
        written out (:func:`~tformer.ops.explicit.explicit_attention`): ``(out (B, nh, T, hs), weights or None)``;
        attention dropout on the weights in training."""
        kept = []
        p = self.attn_dropout if step.dropout else 0.0

        def on_pattern(a: Tensor) -> Tensor:
            kept.append(a)
            return torch.nn.functional.dropout(a, p) if p else a

        out = explicit_attention(q, keys.k, keys.v, scale=self.scale, softcap=self.softcap, on_pattern=on_pattern, **kw)
        return out, (kept[0] if step.return_weights else None)

    def forward_hooked(self, x: Tensor, step: Step, state: KVCache | None) -> Tensor | tuple[Tensor, Tensor]:
        """:meth:`forward` with the attention written out (:func:`~tformer.ops.explicit.explicit_attention`)
        through the hook points ``blocks.{i}.attn.hook_q``, ``hook_k``, ``hook_v`` ``(B, T, nh|nkv, hs)``
        (before RoPE), ``hook_rot_q``, ``hook_rot_k`` (after it), ``hook_attn_scores``,
        ``hook_pattern`` ``(B, nh, T, m)`` and ``hook_z`` ``(B, T, nh, hs)`` (each head's output,
        before ``out_proj``). No attention dropout: hooks are for looking at a trained model."""
        hook, p = step.hooks, f"blocks.{self.layer}.attn."
        B, T, _ = x.shape
        nh, nkv, hs = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = self.qkv_proj(x).view(B, T, nh + 2 * nkv, hs).split([nh, nkv, nkv], dim=2)   # (B, T, heads, hs)
        q, k, v = (hook(p + name, t).transpose(1, 2) for name, t in (("hook_q", q), ("hook_k", k), ("hook_v", v)))
        if self.qk_norm:                                  # as project(): RMS over each head's q and k, before RoPE
            q, k = self.normalise_qk(q, k)
        if self.rope is not None:
            q = hook(p + "hook_rot_q", self.rope(q, step.positions).transpose(1, 2)).transpose(1, 2)
            k = hook(p + "hook_rot_k", self.rope(k, step.positions).transpose(1, 2)).transpose(1, 2)
        keys = state.store(k, v, step) if state is not None else KeyView(k, v, step.mask)
        kw = keys.attention_arguments(causal=self.causal, window=self.window, alibi_slopes=self.alibi_slopes,
                                      backend="math", dtype=q.dtype)
        weights = None

        def on_pattern(pattern: Tensor) -> Tensor:
            nonlocal weights
            weights = hook(p + "hook_pattern", pattern)
            return weights

        out = explicit_attention(q, keys.k, keys.v, on_scores=lambda s: hook(p + "hook_attn_scores", s),
                                 on_pattern=on_pattern, scale=self.scale, softcap=self.softcap, **kw)  # (B, nh, T, hs)
        z = hook(p + "hook_z", out.transpose(1, 2))                             # (B, T, nh, hs)
        return self.finish(z.transpose(1, 2), step, weights)

@dataclass
class CrossMemory:
    """What every decoder layer's cross-attention reads: the encoder's ``memory (B, S, C)``
    (training, recomputation), or per decoder layer its keys/values already projected
    (``kv[i]``: two ``(B, n_kv_heads, S, head_dim)``, each layer's :meth:`CrossAttention.new_state`)."""

    memory: Tensor | None = None
    kv: list[tuple[Tensor, Tensor]] | None = None


class CrossAttention(nn.Module):
    """Encoder-decoder attention (Vaswani et al. §3.2.3) of decoder layer ``layer``.

    Queries come from the decoder's ``x (B, T, C)``, keys and values from the encoder's memory
    ``(B, S, C)``: ``softmax(Q Kᵀ / sqrt(hs)) V`` over every real source token, never causal and
    without positions (the memory carries them). Parameters ``q_proj`` (``C -> nh·hs``),
    ``kv_proj`` (``C -> 2·nkv·hs``, K then V) and ``out_proj``, the names the checkpoints and the
    BART/Marian converters use; ``count_parameters`` equals self-attention's.

    State: the memory's keys/values, projected once per request by :meth:`new_state` and read by
    every decode step (held by the caller in a :class:`CrossMemory`, never by the module).
    Set ``keep_weights`` to store the last weights in ``last_weights`` ``(B, n_heads, T, S)``
    (alignment plots; math backend).
    """

    def __init__(self, config: TransformerConfig, layer: int = 0):
        super().__init__()
        c = config
        self.layer = layer
        self.n_heads, self.n_kv_heads, self.head_dim = c.n_heads, c.n_kv_heads, c.head_dim
        self.backend, self.attn_dropout = c.attention_backend, c.attn_dropout
        q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        self.q_proj = nn.Linear(c.d_model, q_dim, bias=c.qkv_bias)
        self.kv_proj = nn.Linear(c.d_model, 2 * kv_dim, bias=c.qkv_bias)
        self.out_proj = mark_residual(nn.Linear(q_dim, c.d_model, bias=c.bias))
        self.keep_weights, self.last_weights = False, None

    # W_Q, W_K, W_V, W_O and their biases: the same count as self-attention's.
    count_parameters = staticmethod(projection_parameters)

    def new_state(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """This layer's state for one request: memory ``(B, S, C)`` -> keys, values ``(B, n_kv_heads, S, head_dim)``."""
        k, v = self.kv_proj(memory).split(self.n_kv_heads * self.head_dim, dim=-1)     # (B, S, nkv·hs) each
        return split_heads(k, self.n_kv_heads), split_heads(v, self.n_kv_heads)

    def forward(self, x: Tensor, *, context: Tensor | CrossMemory | None = None,
                mask: Tensor | None = None) -> Tensor:
        """``x (B, T, C)`` -> ``(B, T, C)``.

        Args:
            context: the memory ``(B, S, C)``, or a :class:`CrossMemory` (its ``kv[layer]`` when set).
            mask: bool key mask broadcastable to ``(B, nh, T, S)``, ``True`` = attend (source padding).
        """
        if isinstance(context, CrossMemory) and context.kv is not None:
            k, v = context.kv[self.layer]                                               # (B, nkv, S, hs)
        else:
            memory = context.memory if isinstance(context, CrossMemory) else context
            if memory is None:
                raise InputError("cross-attention needs a context: the encoder's memory (B, S, d_model).")
            k, v = self.new_state(memory)                                               # (B, nkv, S, hs)
        q = split_heads(self.q_proj(x), self.n_heads)                                   # (B, nh, T, hs)
        out = scaled_dot_product_attention(
            q, k, v, mask=mask, dropout_p=self.attn_dropout if self.training else 0.0,
            backend="math" if self.keep_weights else self.backend, return_weights=self.keep_weights)
        if self.keep_weights:
            out, self.last_weights = out
        return self.out_proj(merge_heads(out))                                          # (B, T, C)
