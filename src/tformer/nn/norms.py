"""Normalisation: LayerNorm (Ba et al., 2016) or RMSNorm (Zhang & Sennrich, 2019), chosen by the config.

Both rescale each token's vector to unit size before a learned gain; RMSNorm drops the mean
subtraction and the bias (cheaper, and what Llama uses). Where the norm sits in a block is the
block's business (``norm_placement``, :mod:`tformer.models.block`).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tformer.config import TransformerConfig

Tensor = torch.Tensor


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich, 2019): x / sqrt(mean(x²) + eps) · g. No centring, no bias.

    With ``unit_offset`` the gain is ``g = 1 + w`` and ``w`` starts at zero (Gemma's RMSNorm), the product
    taken in float32 before rounding to the input's type, as Gemma's reference does."""

    def __init__(self, dim: int, eps: float = 1e-6, unit_offset: bool = False):
        super().__init__()
        self.eps, self.unit_offset = eps, unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Compute in fp32 for stability under bf16, as Llama does.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (normed * (1.0 + self.weight.float())).to(x.dtype)
        return normed.to(x.dtype) * self.weight


def make_norm(config: TransformerConfig) -> nn.Module:
    """LayerNorm (with a bias iff ``config.bias``) or RMSNorm, per ``config.norm``."""
    if config.norm == "rmsnorm":
        return RMSNorm(config.d_model, eps=config.norm_eps, unit_offset=config.norm_unit_offset)
    return nn.LayerNorm(config.d_model, eps=config.norm_eps, bias=config.bias)
