"""Multi-head attention: MHA, grouped-query (GQA) and multi-query (MQA), self and cross.

``n_kv_heads`` decides the family: ``n_heads`` is MHA (Vaswani et al.), 1 is MQA (Shazeer, 2019),
anything dividing ``n_heads`` is GQA (Ainslie et al., 2023): each key/value head serves
``n_heads / n_kv_heads`` query heads, which shrinks the K/V projections and the KV cache by
that factor. K and V stay at ``n_kv_heads`` width all the way into the attention kernel.

Softmax attention is the ``"attention"`` token mixer (see :mod:`tformer.mixers.base`): its
inference state is a :class:`~tformer.mixers.kv_cache.KVCache`, owned by the caller.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tformer.ops.sdpa import scaled_dot_product_attention
from tformer.config import TransformerConfig
from tformer.errors import InputError
from tformer.mixers.kv_cache import KeyView, KVCache, StaticKVCache
from tformer.mixers.base import Shared, Step
from tformer.nn.markers import mark_residual
from tformer.nn.positions import RotaryEmbedding
from tformer.ops.alibi import alibi_slopes

Tensor = torch.Tensor


class MultiHeadAttention(nn.Module):
    """Attention with ``n_heads`` query heads over ``n_kv_heads`` key/value heads.

    Args:
        config: supplies d_model, n_heads, n_kv_heads, head_dim, biases, positions, backend,
            causal, sliding_window and attn_dropout.
        layer: index in the stack (unused: every layer is alike).
        shared: the model's shared objects; its ``rope`` table when ``config.positions == "rope"``.
        cross: keys and values come from a ``context`` sequence (encoder-decoder); never causal,
            no RoPE/ALiBi.
        rope: the rotary table, when not given through ``shared``.
    """

    def __init__(self, config: TransformerConfig, layer: int = 0, shared: Shared | None = None, *,
                 cross: bool = False, rope: RotaryEmbedding | None = None):
        super().__init__()
        c = config
        self.n_heads, self.n_kv_heads, self.head_dim = c.n_heads, c.n_kv_heads, c.head_dim
        self.cross = cross
        self.causal = c.causal and not cross
        self.window = None if cross else c.sliding_window
        self.backend, self.attn_dropout = c.attention_backend, c.attn_dropout
        q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        if cross:
            self.q_proj = nn.Linear(c.d_model, q_dim, bias=c.qkv_bias)
            self.kv_proj = nn.Linear(c.d_model, 2 * kv_dim, bias=c.qkv_bias)
        else:  # one fused matmul for q, k and v
            self.qkv_proj = nn.Linear(c.d_model, q_dim + 2 * kv_dim, bias=c.qkv_bias)
        self.out_proj = mark_residual(nn.Linear(q_dim, c.d_model, bias=c.bias))
        rope = rope if rope is not None else (shared.rope if shared is not None else None)
        self.rope = None if cross else rope
        use_alibi = c.positions == "alibi" and not cross
        self.register_buffer("alibi_slopes", alibi_slopes(c.n_heads) if use_alibi else None, persistent=False)

    # ------------------------------------------------------------------ the mixer protocol
    @classmethod
    def count_parameters(cls, config: TransformerConfig) -> int:
        """W_Q, W_K, W_V (+ biases) and W_O (+ bias) of one layer."""
        c = config
        q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        return (c.d_model + c.qkv_bias) * (q_dim + 2 * kv_dim) + q_dim * c.d_model + c.d_model * c.bias

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
        context: Tensor | None = None,
        mask: Tensor | None = None,
        positions: Tensor | None = None,
        return_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attend from ``x (B, T, C)``.

        Args:
            step: what the model computed for this call (positions, padding mask, start_pos,
                dropout); when ``None`` the keywords below are used (direct use).
            state: this layer's KV cache (anything with ``store(k, v, step) -> KeyView``), or
                ``None`` (attend over ``x`` or ``context`` alone).
            context: ``(B, S, C)`` keys/values source for cross-attention.
            mask: bool key mask broadcastable to ``(B, nh, T, m)``, ``True`` = attend (padding).
            positions: absolute positions of the ``T`` queries, ``(T,)`` or ``(B, T)`` (RoPE);
                default ``arange(T)``.
            return_weights: also return ``(B, nh, T, m)`` attention weights (math backend).
        Returns:
            ``(B, T, C)``, or ``(out, weights)``.
        """
        B, T, _ = x.shape
        if step is None:
            if positions is None and self.rope is not None:
                positions = torch.arange(T, device=x.device)
            step = Step(positions=positions, mask=mask, dropout=self.training, return_weights=return_weights)
        hs, nh, nkv = self.head_dim, self.n_heads, self.n_kv_heads
        if self.cross:
            if context is None:
                raise InputError("cross-attention needs a context tensor (B, S, d_model).")
            q = self.q_proj(x)
            k, v = self.kv_proj(context).split(nkv * hs, dim=-1)
        else:
            q, k, v = self.qkv_proj(x).split([nh * hs, nkv * hs, nkv * hs], dim=-1)
        q = q.view(B, T, nh, hs).transpose(1, 2)                     # (B, nh, T, hs)
        k = k.view(B, k.shape[1], nkv, hs).transpose(1, 2)           # (B, nkv, m, hs)
        v = v.view(B, v.shape[1], nkv, hs).transpose(1, 2)           # (B, nkv, m, hs)
        if self.rope is not None:  # rotate new q and k; cached keys were rotated when written
            q, k = self.rope(q, step.positions), self.rope(k, step.positions)

        # The cache decides how the new keys are written and what is read (eager prefix, or a static
        # step's whole buffer with each row's query index); without one, attend over k and v alone.
        keys = state.store(k, v, step) if state is not None else KeyView(k, v, step.mask)
        # ALiBi goes in as slopes: flash computes -slope * |p_q - p_k| per block, the other
        # backends build the dense (nh, T, m) bias (queries at key positions m - T .. m - 1).
        result = scaled_dot_product_attention(
            q, keys.k, keys.v, dropout_p=self.attn_dropout if step.dropout else 0.0,
            return_weights=step.return_weights,
            **keys.attention_arguments(causal=self.causal, window=self.window, alibi_slopes=self.alibi_slopes,
                                       backend=self.backend, dtype=q.dtype),
        )
        out, weights = result if step.return_weights else (result, None)
        out = self.out_proj(out.transpose(1, 2).reshape(B, T, nh * hs))   # re-assemble heads: (B, T, C)
        return (out, weights) if step.return_weights else out
