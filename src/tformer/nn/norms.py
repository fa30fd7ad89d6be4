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

    def gain(self) -> Tensor:
        """The gain ``g`` the normed vector is multiplied by, float32 ``(dim,)``: ``1 + w`` with ``unit_offset``
        (the sum in float32), else ``w``. The one home of that rule: the forward, the fused plan and the
        logit attribution read it here."""
        w = self.weight.float()
        return 1.0 + w if self.unit_offset else w

    def forward(self, x: Tensor) -> Tensor:
        # Compute in fp32 for stability under bf16, as Llama does.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (normed * self.gain()).to(x.dtype)        # Gemma's: the product in float32, then rounded
        return normed.to(x.dtype) * self.weight              # Llama's: rounded, then the weight in its own dtype


def make_norm(config: TransformerConfig) -> nn.Module:
    """LayerNorm (with a bias iff ``config.bias``) or RMSNorm, per ``config.norm``."""
    if config.norm == "rmsnorm":
        return RMSNorm(config.d_model, eps=config.norm_eps, unit_offset=config.norm_unit_offset)
    return nn.LayerNorm(config.d_model, eps=config.norm_eps, bias=config.bias)
