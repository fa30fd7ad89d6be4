"""Activation checkpointing (``--set checkpointing=true``): per block, the forward keeps only each block's
input ``x (B, T, C)``; the backward runs the block again to get what its own backward needs.

Without it a block keeps every intermediate its backward reads (the normed inputs, q, k, v, the attention
output and its statistics, the feed-forward's hidden ``(B, T, d_ff)`` pair, ...), roughly
``(10 C + 3 d_ff) · B · T`` numbers per layer for a Llama block; with it one ``C · B · T`` per layer, plus one
block's intermediates at a time during the backward. The price is one more forward of the blocks per step
(about a third more matmul work: forward 1, backward 2, recomputation 1).

The recomputation replays the block exactly: ``torch.utils.checkpoint`` (non-reentrant) restores the RNG
state of the forward (dropout draws from torch's default generator, ``ops/dropout.py``), and autocast's
state is saved and replayed with it, so gradients equal the plain step's to rounding (tested in fp32 to
1e-6). It composes with LoRA (adapters live inside the blocks), the shared prefix (its per-layer key
store is pure), bf16 autocast and DDP / FSDP2 (non-reentrant checkpointing is what both support).
"""

from __future__ import annotations

from torch import nn

from tformer.errors import ConfigError
from tformer.models.stack import TransformerStack


def enable_checkpointing(model: nn.Module, trim_heap: bool = False) -> int:
    """Turn on per-block checkpointing in every transformer stack of ``model``; the number of blocks covered.
    ``trim_heap``: before each checkpointed block runs (its forward and its recomputation), hand the heap's
    free pages back to the OS (:func:`tformer.machine.release_free_heap`): the backward's blocks then reuse
    fresh pages instead of keeping every size freed so far resident (peak RSS, not a number, changes).

    Raises:
        ConfigError: ``model`` has no transformer blocks (an RNN seq2seq model).
    """
    stacks = [m for m in model.modules() if isinstance(m, TransformerStack)]
    if not stacks:
        raise ConfigError(f"checkpointing=true needs a model made of transformer blocks; this "
                          f"{type(model).__name__} has none: drop --set checkpointing=true.")
    for stack in stacks:
        stack.checkpointing, stack.trim_heap = True, trim_heap
    return sum(len(s.blocks) for s in stacks)
