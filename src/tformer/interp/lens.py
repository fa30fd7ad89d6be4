"""The logit lens and the tuned lens: what the residual stream would predict if the model stopped there.

Logit lens (nostalgebraist, 2020): read block ``l``'s input ``h_l`` with the model's own final norm
and unembedding, ``lens_l = W_U · norm(h_l)``. The last entry (after the last block) is the model's
logits. Early layers are often not in the unembedding's basis, so the lens reads them badly.

Tuned lens (Belrose et al., 2023): one affine translator per layer, ``A_l h + b_l`` (initialised
to the identity), trained so that ``W_U · norm(A_l h_l + b_l)`` matches the model's final
distribution: the loss is KL(final ‖ lens), the model itself frozen.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from tformer.errors import InputError
from tformer.interp.hooks import run_with_cache

Tensor = torch.Tensor


def unembed(model: nn.Module, resid: Tensor) -> Tensor:
    """``(…, C)`` residual stream -> ``(…, vocab)`` logits through the final norm and the head."""
    return model.lm_head(model.final_norm(resid))


def residual_stack(model: nn.Module, ids: Tensor) -> tuple[Tensor, Tensor]:
    """``(logits (B, T, V), stack (L+1, B, T, C))``: the residual stream entering each block and after the last."""
    names = [f"blocks.{i}.hook_resid_pre" for i in range(len(model.blocks))]
    names.append(f"blocks.{len(model.blocks) - 1}.hook_resid_post")
    logits, cache = run_with_cache(model, ids, names=names)
    return logits, cache.accumulated_resid()


@torch.no_grad()
def logit_lens(model: nn.Module, ids: Tensor) -> Tensor:
    """``(L+1, B, T, vocab)``: the logit lens at the input of every block and after the last one."""
    _, stack = residual_stack(model, ids)
    return unembed(model, stack)


def kl_to_final(final_logits: Tensor, lens_logits: Tensor) -> Tensor:
    """KL(final ‖ lens) in nats, per position: ``(…)`` from two ``(…, vocab)`` logits."""
    p = F.log_softmax(final_logits.float(), -1)
    return (p.exp() * (p - F.log_softmax(lens_logits.float(), -1))).sum(-1)


class TunedLens(nn.Module):
    """One affine translator ``C -> C`` per block input (``n_layers`` of them; the stream after the
    last block needs none: it *is* what the head reads)."""

    def __init__(self, d_model: int, n_layers: int):
        super().__init__()
        self.translators = nn.ModuleList(nn.Linear(d_model, d_model) for _ in range(n_layers))
        for t in self.translators:                                              # start as the logit lens
            nn.init.eye_(t.weight)
            nn.init.zeros_(t.bias)

    def forward(self, model: nn.Module, stack: Tensor) -> Tensor:
        """``(L+1, B, T, C)`` residual stack -> ``(L+1, B, T, vocab)`` tuned-lens logits."""
        translated = [t(h) for t, h in zip(self.translators, stack[:-1])] + [stack[-1]]
        return unembed(model, torch.stack(translated))


def fit_tuned_lens(model: nn.Module, batches: Iterable[Tensor], steps: int = 100, lr: float = 1e-3,
                   seed: int = 0) -> TunedLens:
    """Train a :class:`TunedLens` for ``model`` (frozen) on ``steps`` batches of ids drawn cyclically
    from ``batches``: Adam on the mean over layers and positions of KL(final ‖ tuned lens)."""
    batches = list(batches)
    if not batches:
        raise InputError("fit_tuned_lens needs at least one batch of token ids (B, T) to train on; got none.")
    if steps < 1:
        raise InputError(f"fit_tuned_lens: steps={steps} must be at least 1.")
    torch.manual_seed(seed)
    lens = TunedLens(model.config.d_model, len(model.blocks))
    opt = torch.optim.Adam(lens.parameters(), lr=lr)
    params = list(model.parameters())
    was = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(False)
    try:
        for step in range(steps):
            with torch.no_grad():
                logits, stack = residual_stack(model, batches[step % len(batches)])
            loss = kl_to_final(logits, lens(model, stack)[:-1]).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        for p, w in zip(params, was):
            p.requires_grad_(w)
    return lens.eval()
