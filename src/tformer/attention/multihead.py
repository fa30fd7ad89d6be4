"""Multi-head attention: MHA, grouped-query (GQA) and multi-query (MQA), self and cross.

``n_kv_heads`` decides the family: ``n_heads`` is MHA (Vaswani et al.), 1 is MQA (Shazeer, 2019),
anything dividing ``n_heads`` is GQA (Ainslie et al., 2023): each key/value head serves
``n_heads / n_kv_heads`` query heads, which shrinks the K/V projections and the KV cache by
that factor. K and V stay at ``n_kv_heads`` width all the way into the attention kernel.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tformer.attention.functional import scaled_dot_product_attention
from tformer.config import TransformerConfig
from tformer.positions import RotaryEmbedding, alibi_slopes

Tensor = torch.Tensor


class MultiHeadAttention(nn.Module):
    """Attention with ``n_heads`` query heads over ``n_kv_heads`` key/value heads.

    Args:
        config: supplies d_model, n_heads, n_kv_heads, head_dim, biases, positions, backend,
            causal, sliding_window and attn_dropout.
        cross: keys and values come from a ``context`` sequence (encoder-decoder); never causal,
            no RoPE/ALiBi.
        rope: a shared :class:`RotaryEmbedding` when ``config.positions == "rope"``.

    Attributes:
        kv_cache: ``None``, or an object with ``update(start_pos, k, v) -> (k_all, v_all)``
            holding earlier keys/values (see ``tformer.inference.kv_cache``).
    """

    def __init__(self, config: TransformerConfig, cross: bool = False, rope: RotaryEmbedding | None = None):
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
        self.out_proj = nn.Linear(q_dim, c.d_model, bias=c.bias)
        self.rope = None if cross else rope
        use_alibi = c.positions == "alibi" and not cross
        self.register_buffer("alibi_slopes", alibi_slopes(c.n_heads) if use_alibi else None, persistent=False)
        self.kv_cache = None

    def forward(
        self,
        x: Tensor,
        *,
        context: Tensor | None = None,
        mask: Tensor | None = None,
        positions: Tensor | None = None,
        start_pos: int = 0,
        return_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attend from ``x (B, T, C)``.

        Args:
            context: ``(B, S, C)`` keys/values source for cross-attention.
            mask: bool key mask broadcastable to ``(B, nh, T, m)``, ``True`` = attend (padding).
            positions: absolute positions of the ``T`` queries, ``(T,)`` or ``(B, T)`` (RoPE);
                default ``start_pos + arange(T)``.
            start_pos: how many tokens the KV cache already holds (0 without a cache).
            return_weights: also return ``(B, nh, T, m)`` attention weights (math backend).
        Returns:
            ``(B, T, C)``, or ``(out, weights)``.
        """
        B, T, _ = x.shape
        hs, nh, nkv = self.head_dim, self.n_heads, self.n_kv_heads
        if self.cross:
            if context is None:
                raise ValueError("cross-attention needs a context tensor (B, S, d_model).")
            q = self.q_proj(x)
            k, v = self.kv_proj(context).split(nkv * hs, dim=-1)
        else:
            q, k, v = self.qkv_proj(x).split([nh * hs, nkv * hs, nkv * hs], dim=-1)
        q = q.view(B, T, nh, hs).transpose(1, 2)                     # (B, nh, T, hs)
        k = k.view(B, k.shape[1], nkv, hs).transpose(1, 2)           # (B, nkv, m, hs)
        v = v.view(B, v.shape[1], nkv, hs).transpose(1, 2)           # (B, nkv, m, hs)

        if positions is None and (self.rope is not None):
            positions = torch.arange(start_pos, start_pos + T, device=x.device)
        if self.rope is not None:  # rotate new q and k; cached keys were rotated when written
            q, k = self.rope(q, positions), self.rope(k, positions)
        if self.kv_cache is not None:
            k, v = self.kv_cache.update(start_pos, k, v)             # (B, nkv, start_pos + T, hs)

        # ALiBi goes in as slopes: flash computes -slope * |p_q - p_k| per block, the other
        # backends build the dense (nh, T, m) bias (queries at key positions m - T .. m - 1).
        result = scaled_dot_product_attention(
            q, k, v, mask=mask, causal=self.causal, window=self.window, alibi_slopes=self.alibi_slopes,
            dropout_p=self.attn_dropout if self.training else 0.0,
            backend=self.backend, return_weights=return_weights,
        )
        out, weights = result if return_weights else (result, None)
        out = out.transpose(1, 2).reshape(B, T, nh * hs)              # re-assemble heads: (B, T, C)
        out = self.out_proj(out)
        return (out, weights) if return_weights else out
