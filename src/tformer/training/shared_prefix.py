"""The loss of a batch whose rows begin with the same tokens, their common prefix computed once.

A chat template that opens every conversation with the same system prompt (SmolLM2's and Qwen's
put a default one before any conversation without its own) gives every training example the same
first ``P`` tokens: SmolLM2's ChatML block ``<|im_start|>system ... <|im_end|> <|im_start|>user``
is 26 tokens of the built-in task's ~56. In a causal model the hidden states at positions ``< P``
depend on tokens ``< P`` only, so they are the same in every row. One forward of ``B + 1`` rows of
``L = max(P, T - P)`` tokens computes them once:

    row 0:        the prefix, ids[0, :P] at positions 0 .. P-1        (right-padded to L)
    rows 1 .. B:  each row's rest, ids[b, P:] at positions P .. T-1   (right-padded to L)
    every layer:  keys (B+1, nkv, P + L, hs) = [row 0's first P keys, expanded to B+1 rows; the row's own L]
                  row 0 is masked off the first P slots (it reads its own keys in the last L);
                  rows 1 .. B read all P prefix slots and their own keys causally

so rows ``1 .. B`` see exactly the keys and values the full ``(B, T)`` forward gives them, and the
loss (their targets; row 0 has none) is the same. So are the gradients: the backward of the expand
sums the B rows' gradients flowing into the one prefix, which is what the B identical copies each
received, summed in the weights. Cost: ``(B + 1) · L`` positions through every linear instead of ``B · T``
(the built-in task's batches of 8: 0.60), in one call, so each weight is read once per pass (a separate ``(1,
P)`` prefix call made its matmuls memory-bound: measured, it cost far more than its share of the FLOPs;
docs/finetune.md#where-a-steps-time-goes-profile). The masked attention is ``(B+1) · L · (P + L)`` query-key
pairs (the built-in task: 15 k), fewer than the plain ``B · T²`` (25 k).

Used only where it is exact: a decoder whose every layer is attention (a recurrent or ring state
has no keys to share), no target inside the prefix (the prefix needs no logits; ``P`` is cut at the
first labelled position), no dropout anywhere in the model (a shared prefix would share its
dropout masks across rows), no hooks; otherwise, for a prefix under ``min_prefix`` tokens, or where
the layout saves under a tenth of the positions, the plain forward.
"""

from __future__ import annotations

import torch
from torch import nn

from tformer.mixers.attention import MultiHeadAttention
from tformer.mixers.kv_cache import KeyView
from tformer.models.decoder import DecoderLM
from tformer.models.state import InferenceState

IGNORE = -100
MIN_PREFIX = 8      # below this the extra row and the mask are not worth the positions they save


class _SharedPrefix:
    """Every layer's state in the shared-prefix call: row 0's first ``P`` keys and values before each
    row's own, under the mask of the module docstring (the same for every layer)."""

    def __init__(self, P: int, mask: torch.Tensor):
        self.P, self.mask = P, mask                                            # mask (B+1, 1, L, P + L)

    def store(self, k: torch.Tensor, v: torch.Tensor, step) -> KeyView:
        rows = k.shape[0]                                                      # k, v (B+1, nkv, L, hs)
        keys = torch.cat([k[:1, :, :self.P].expand(rows, -1, -1, -1), k], dim=2)       # (B+1, nkv, P+L, hs)
        values = torch.cat([v[:1, :, :self.P].expand(rows, -1, -1, -1), v], dim=2)
        return KeyView(keys, values, self.mask)


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


def positions_run(B: int, T: int, P: int, min_prefix: int = MIN_PREFIX) -> int:
    """Positions the shared-prefix call runs through every linear for a ``(B, T)`` batch with a
    shared prefix of ``P`` tokens: ``(B + 1) · max(P, T - P)``, or ``B · T`` where it falls back."""
    L = max(P, T - P)
    return B * T if P < min_prefix or (B + 1) * L > 0.9 * B * T else (B + 1) * L


def prefix_shared_loss(model: DecoderLM, ids: torch.Tensor, targets: torch.Tensor, pad_id: int = 0,
                       min_prefix: int = MIN_PREFIX) -> torch.Tensor:
    """The mean cross-entropy of ``model(ids, targets, labelled_only=True)``, computed with the
    batch's shared prefix run once (the caller checks :func:`can_share`). ids, targets: ``(B, T)``;
    ``pad_id`` fills the layout's padding (never attended to, never a target)."""
    P = shared_prefix_length(ids, targets)
    B, T = ids.shape
    L = max(P, T - P)
    if positions_run(B, T, P, min_prefix) == B * T:
        return model(ids, targets, labelled_only=True)[1]
    dev = ids.device
    x = torch.full((B + 1, L), pad_id, dtype=ids.dtype, device=dev)
    y = torch.full((B + 1, L), IGNORE, dtype=targets.dtype, device=dev)
    x[0, :P], x[1:, :T - P], y[1:, :T - P] = ids[0, :P], ids[:, P:], targets[:, P:]
    steps = torch.arange(L, device=dev)
    positions = torch.cat([steps[None], P + steps[None].expand(B, -1)])                 # (B+1, L)
    # slot j < P: prefix key j (rows >= 1 only); slot P + j: the row's own key j (causal: j <= query i)
    own = steps[None, :] <= steps[:, None]                                              # (L, L)
    mask = torch.cat([torch.ones(B + 1, L, P, dtype=torch.bool, device=dev),
                      own.expand(B + 1, -1, -1)], dim=2)                                # (B+1, L, P+L)
    mask[0, :, :P] = False
    state = InferenceState([_SharedPrefix(P, mask[:, None]) for _ in model.blocks], B + 1, L, dev)
    return model(x, y, positions=positions, state=state, labelled_only=True)[1]
