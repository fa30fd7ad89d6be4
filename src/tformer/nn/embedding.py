"""Pieces of the input side that the model stack (``tformer.models.stack``) and the entry points
use: the id check, the absolute-position table, and GPT-2's weight initialisation (or none, for a
model whose weights are about to be loaded)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn as nn

from tformer.config import TransformerConfig
from tformer.errors import InputError
from tformer.nn.positions import LearnedPositions, SinusoidalPositions

Tensor = torch.Tensor


def check_ids(ids: Tensor, vocab_size: int) -> None:
    """Raise a clear InputError unless ``ids`` is a ``(B, T)`` integer tensor inside the vocabulary."""
    if ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
        raise InputError(f"ids must be a (batch, seq_len) integer tensor, got {ids.dtype} {tuple(ids.shape)}.")
    if ids.numel() and (int(ids.max()) >= vocab_size or int(ids.min()) < 0):
        raise InputError(
            f"token ids must be in [0, {vocab_size}); got range [{int(ids.min())}, {int(ids.max())}]. "
            f"Is the tokenizer the one this model was built for?"
        )


def position_table(config: TransformerConfig) -> nn.Module | None:
    """The table added to the token embedding (learned or sinusoidal), or None (RoPE, ALiBi, none)."""
    kinds = {"learned": LearnedPositions, "sinusoidal": SinusoidalPositions}
    return kinds[config.positions](config.context_length, config.d_model) if config.positions in kinds else None


def init_weights(module: nn.Module, std: float) -> None:
    """GPT-2 / BERT initialisation: N(0, std) for matrices and embeddings, zero biases.
    Use as ``model.apply(lambda m: init_weights(m, config.init_std))``."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, (nn.Embedding, LearnedPositions)):
        nn.init.normal_(module.weight, mean=0.0, std=std)


# torch.nn.init's in-place fills that module constructors (and init_weights) call
_FILLS = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
          "trunc_normal_", "zeros_", "ones_", "constant_")


@contextlib.contextmanager
def skip_init() -> Iterator[None]:
    """Build modules without filling their weights: inside, ``torch.nn.init``'s fills leave tensors as
    allocated. For a model whose every weight is loaded next (a strict ``load_state_dict``): drawing
    random numbers for 135M parameters only to overwrite them is most of a small model's load time, and
    untouched float pages that block weights later replace never become resident. Not thread-safe:
    construction on one thread at a time."""
    saved = {name: getattr(nn.init, name) for name in _FILLS}
    try:
        for name in _FILLS:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fill in saved.items():
            setattr(nn.init, name, fill)
