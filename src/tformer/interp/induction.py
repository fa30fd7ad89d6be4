"""Induction heads (Olsson et al., 2022): heads that, at a repeated token, attend to the token that
followed its previous occurrence ("... A B ... A" -> look at B), which lets the model copy B.

The test sequence is TransformerLens's: a start token, then ``n`` random tokens, then the same
``n`` again (length ``2n + 1``). The token at position ``i`` of the second half first appeared at
``i - n``, and the token after it is at ``i - n + 1``: an induction head's pattern is a stripe on
the diagonal ``dest - src = n - 1``. A head's score is the mean of its pattern on that stripe
(over the batch and every destination on it), so 1 is a perfect induction head and a uniform head
scores about ``1 / i``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tformer.interp.hooks import run_with_cache

Tensor = torch.Tensor


def repeated_tokens(n: int, batch: int, vocab: tuple[int, int], start: int, seed: int = 0) -> Tensor:
    """``(batch, 2n + 1)``: ``start``, then ``n`` tokens uniform in ``[vocab[0], vocab[1])``, repeated."""
    g = torch.Generator().manual_seed(seed)
    half = torch.randint(vocab[0], vocab[1], (batch, n), generator=g)
    return torch.cat([torch.full((batch, 1), start), half, half], dim=1)


def stripe_scores(pattern: Tensor, n: int) -> Tensor:
    """``(B, nh, T, T)`` pattern -> ``(nh,)``: mean attention on the diagonal ``dest - src = n - 1``."""
    return pattern.diagonal(offset=1 - n, dim1=-2, dim2=-1).mean(dim=(0, -1))


@torch.no_grad()
def induction_scores(model: nn.Module, ids: Tensor) -> Tensor:
    """``(n_layers, n_heads)`` induction scores of every head on ``ids`` from :func:`repeated_tokens`."""
    n = (ids.shape[1] - 1) // 2
    L = len(model.blocks)
    _, cache = run_with_cache(model, ids, names=[f"blocks.{l}.attn.hook_pattern" for l in range(L)])
    return torch.stack([stripe_scores(cache["pattern", l], n) for l in range(L)])
