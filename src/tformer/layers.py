"""The pieces of a transformer block: normalisation, feed-forward, and the block that joins them.

A block is two residual sub-layers, attention (tokens talk to each other) then a feed-forward
(each token thinks alone). ``norm_placement`` decides where the norm sits:

- ``pre``  (GPT-2, Llama): ``x = x + f(norm(x))``: the residual stream is never normalised,
  which keeps gradients well-behaved in deep stacks.
- ``post`` (Vaswani et al., BERT): ``x = norm(x + f(x))``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tformer.attention.multihead import MultiHeadAttention
from tformer.config import TransformerConfig
from tformer.positions import RotaryEmbedding

Tensor = torch.Tensor


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich, 2019): x / sqrt(mean(x²) + eps) · g. No centring, no bias."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Compute in fp32 for stability under bf16, as Llama does.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


def make_norm(config: TransformerConfig) -> nn.Module:
    """LayerNorm (with a bias iff ``config.bias``) or RMSNorm, per ``config.norm``."""
    if config.norm == "rmsnorm":
        return RMSNorm(config.d_model, eps=config.norm_eps)
    return nn.LayerNorm(config.d_model, eps=config.norm_eps, bias=config.bias)


_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),                      # exact erf form (BERT, Vaswani-era GELU)
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # GPT-2's approximation
    "relu": F.relu,
    "silu": F.silu,
}


class MLP(nn.Module):
    """Position-wise feed-forward: Linear(d, d_ff) -> activation -> Linear(d_ff, d) -> dropout."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.up = nn.Linear(config.d_model, config.d_ff, bias=config.bias)
        self.down = nn.Linear(config.d_ff, config.d_model, bias=config.bias)
        self.act = _ACTIVATIONS[config.activation]

    def forward(self, x: Tensor) -> Tensor:
        return self.down(self.act(self.up(x)))


class SwiGLU(nn.Module):
    """Gated feed-forward (Shazeer, 2020; Llama): down(silu(gate(x)) * up(x)).

    Three matrices instead of two, so d_ff ≈ 8/3 · d keeps the parameter count of a 4d MLP.
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.gate = nn.Linear(config.d_model, config.d_ff, bias=config.bias)
        self.up = nn.Linear(config.d_model, config.d_ff, bias=config.bias)
        self.down = nn.Linear(config.d_ff, config.d_model, bias=config.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


def make_feed_forward(config: TransformerConfig) -> nn.Module:
    return SwiGLU(config) if config.ffn == "swiglu" else MLP(config)


class _MixerBlock(nn.Module):
    """TEMPORARY shim (issue-11 branch) until main's mixer seam lands: pre-norm mixer (+ optional ffn)."""

    def __init__(self, config: TransformerConfig, layer: int):
        super().__init__()
        from tformer.mixers import mixer_class
        self.mixer_norm = make_norm(config)
        self.mixer = mixer_class(config.layer_mixers()[layer])(config, layer, None)
        self.ffn_norm = make_norm(config) if config.ffn != "none" else None
        self.ffn = make_feed_forward(config) if config.ffn != "none" else None

    def forward(self, x, *, positions=None, **_):
        from tformer.mixers.base import Step
        x = x + self.mixer(self.mixer_norm(x), Step(positions=positions), None)
        return x if self.ffn is None else x + self.ffn(self.ffn_norm(x))


class Block(nn.Module):
    """One transformer layer: self-attention, optional cross-attention, feed-forward; each residual.

    Args:
        config: the model's config (``norm_placement``, ``dropout``, ...).
        cross_attention: add an encoder-decoder attention sub-layer (Vaswani et al.'s decoder).
        rope: the model's shared rotary table when positions are ``rope``.
    """

    def __init__(self, config: TransformerConfig, cross_attention: bool = False,
                 rope: RotaryEmbedding | None = None):
        super().__init__()
        self.pre_norm = config.norm_placement == "pre"
        self.attn_norm = make_norm(config)
        self.attn = MultiHeadAttention(config, rope=rope)
        self.cross_norm = make_norm(config) if cross_attention else None
        self.cross_attn = MultiHeadAttention(config, cross=True) if cross_attention else None
        self.ffn_norm = make_norm(config)
        self.ffn = make_feed_forward(config)
        self.dropout = nn.Dropout(config.dropout)

    def _residual(self, x: Tensor, norm: nn.Module, f) -> Tensor:
        if self.pre_norm:
            return x + self.dropout(f(norm(x)))
        return norm(x + self.dropout(f(x)))

    def forward(
        self,
        x: Tensor,
        *,
        mask: Tensor | None = None,
        positions: Tensor | None = None,
        start_pos: int = 0,
        context: Tensor | None = None,
        context_mask: Tensor | None = None,
        return_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """``x (B, T, C)`` -> ``(B, T, C)``; with ``return_weights`` also the self-attention weights."""
        weights = None

        def self_attention(h: Tensor) -> Tensor:
            nonlocal weights
            out = self.attn(h, mask=mask, positions=positions, start_pos=start_pos,
                            return_weights=return_weights)
            if return_weights:
                out, weights = out
            return out

        x = self._residual(x, self.attn_norm, self_attention)
        if self.cross_attn is not None:
            x = self._residual(x, self.cross_norm,
                               lambda h: self.cross_attn(h, context=context, mask=context_mask))
        x = self._residual(x, self.ffn_norm, self.ffn)
        return (x, weights) if return_weights else x
