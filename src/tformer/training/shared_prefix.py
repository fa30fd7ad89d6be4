"""The loss of a batch whose rows begin with the same tokens, their common prefix computed once.

A chat template that opens every conversation with the same system prompt (SmolLM2's and Qwen's
put a default one before any conversation without its own) gives every training example the same
first ``P`` tokens: SmolLM2's ChatML block ``<|im_start|>system ... <|im_end|> <|im_start|>user``
is about 30 tokens of the built-in task's ~55. In a causal model the hidden states at positions
``< P`` depend on tokens ``< P`` only, so they are the same in every row. So:

    prefix pass:  row 0's first P tokens, ids (1, P) -> each layer's keys and values (1, nkv, P, hs)
    rest:         ids (B, T - P) at positions P .. T-1, each layer attending over
                  [prefix keys expanded to B rows; its own keys]  (B, nkv, T, hs), causal bottom-right

gives the same hidden states at positions ``>= P`` as the full ``(B, T)`` forward, and so the same
loss, and the same gradients: the backward of the expand sums the B rows' gradients flowing into the
one prefix, which is what the B identical copies would each have received and the weights summed.
Cost: ``P + B·(T - P)`` positions through every linear instead of ``B·T`` (the built-in task's
batches of 8: about 0.55 of the positions); the outputs differ by rounding only (another order of
summation in the weights' gradients).

Used only where it is exact: a decoder whose every layer is attention (a recurrent or ring state
has no keys to share), no target inside the prefix (the prefix needs no logits; ``P`` is cut at the
first labelled position), no dropout anywhere in the model (a shared prefix would share its
dropout masks across rows), no hooks; otherwise (or for a prefix of under ``min_prefix`` tokens)
the plain forward.
"""

from __future__ import annotations

import torch
from torch import nn

from tformer.mixers.attention import MultiHeadAttention
from tformer.mixers.kv_cache import KeyView
from tformer.models.decoder import DecoderLM
from tformer.models.state import InferenceState

IGNORE = -100
MIN_PREFIX = 8      # below this the second call's overhead is not worth the positions it saves


class _Record:
    """A layer state for the prefix pass: keeps this layer's keys and values (with their autograd
    history) and attends over them as a stateless call would."""

    def __init__(self):
        self.k = self.v = None

    def store(self, k: torch.Tensor, v: torch.Tensor, step) -> KeyView:
        self.k, self.v = k, v                                                  # (1, nkv, P, hs)
        return KeyView(k, v, step.mask)


class _Prefixed:
    """A layer state for the rest of the batch: the one prefix's keys and values before each row's own."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v = k, v                                                  # (1, nkv, P, hs)

    def store(self, k: torch.Tensor, v: torch.Tensor, step) -> KeyView:
        B = k.shape[0]
        keys = torch.cat([self.k.expand(B, -1, -1, -1), k], dim=2)             # (B, nkv, P + S, hs)
        values = torch.cat([self.v.expand(B, -1, -1, -1), v], dim=2)
        return KeyView(keys, values, step.mask)


def shared_prefix_length(ids: torch.Tensor, targets: torch.Tensor) -> int:
    """``P``: the positions at the start where every row has the same token and no row a target,
    at most ``T - 1`` (one position is left for the rest). ids, targets: ``(B, T)``."""
    T = ids.shape[1]
    same = (ids == ids[:1]).all(0).long()                                     # (T,)
    common = int(same.cumprod(0).sum())
    labelled = (targets != IGNORE).any(0).nonzero()                            # (n, 1)
    first = int(labelled[0, 0]) if labelled.numel() else T
    return max(0, min(common, first, T - 1))


def can_share(model: nn.Module) -> bool:
    """Whether :func:`prefix_shared_loss` is exact for ``model`` (see the module docstring)."""
    if not isinstance(model, DecoderLM) or model.hooks is not None:
        return False
    c = model.config
    if c.dropout > 0 or c.attn_dropout > 0:
        return False
    if not all(type(b.attn) is MultiHeadAttention for b in model.blocks):
        return False
    return not any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules())


def prefix_shared_loss(model: DecoderLM, ids: torch.Tensor, targets: torch.Tensor,
                       min_prefix: int = MIN_PREFIX) -> torch.Tensor:
    """The mean cross-entropy of ``model(ids, targets, labelled_only=True)``, computed with the
    batch's shared prefix run once (the caller checks :func:`can_share`). ids, targets: ``(B, T)``."""
    P = shared_prefix_length(ids, targets)
    if P < min_prefix:
        return model(ids, targets, labelled_only=True)[1]
    B, T = ids.shape
    layers = [_Record() for _ in model.blocks]
    model.hidden_states(ids[:1, :P], state=InferenceState(layers, 1, P, ids.device))   # only the keys are kept
    rest = InferenceState([_Prefixed(r.k, r.v) for r in layers], B, T, ids.device)
    rest.length = P
    rest.valid[:, :P] = True
    return model(ids[:, P:], targets[:, P:], state=rest, labelled_only=True)[1]
