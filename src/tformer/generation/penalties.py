"""Penalties and biases on the logits before a token is chosen: repetition, presence, frequency, logit_bias.

For row ``b`` and token ``i``, with ``seen[b, i]`` (``i`` occurs in the prompt or the tokens generated so
far) and ``count[b, i]`` (times ``i`` was generated):

    l_i <- l_i / r   if seen and l_i > 0         repetition penalty r (CTRL, Keskar et al. 2019):
    l_i <- l_i * r   if seen and l_i <= 0        a seen token's probability always falls for r > 1
    l_i <- l_i - count_i * frequency - [count_i > 0] * presence         (OpenAI's two penalties)
    l_i <- l_i + bias_i                                                  (logit_bias)

Which tokens count: the repetition penalty reads the whole sequence, prompt included (transformers'
``RepetitionPenaltyLogitsProcessor`` and vLLM do the same); presence and frequency read only the
generated tokens (OpenAI's "the text so far" as vLLM reads it), so a long prompt does not push its own
words out of the answer. llama.cpp applies all three to its last ``penalty_last_n`` (64) tokens instead.

:class:`History` keeps ``seen`` and ``count`` as ``(B, V)`` tensors updated once per token, so a step
costs O(B·V) whatever the length. Used by :func:`tformer.generation.generate.generate_tokens` and the
server's batched choice (:mod:`tformer.serve.sampling`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tformer.errors import InputError

Tensor = torch.Tensor

# OpenAI's ranges: penalties in [-2, 2], biases in [-100, 100]; a repetition penalty is a factor > 0.
PENALTY_LIMIT, BIAS_LIMIT = 2.0, 100.0


@dataclass(frozen=True)
class Penalties:
    """One sequence's penalties: ``repetition`` (1: none), ``presence`` and ``frequency`` (0: none) and
    ``bias`` (``(token, added logit)`` pairs)."""

    repetition: float = 1.0
    presence: float = 0.0
    frequency: float = 0.0
    bias: tuple[tuple[int, float], ...] = ()

    @property
    def active(self) -> bool:
        return self.repetition != 1.0 or bool(self.presence) or bool(self.frequency) or bool(self.bias)

    def check(self, vocab_size: int | None = None, flags: bool = False) -> None:
        """Raise ``InputError`` naming the bad option and its range (``flags``: as a command-line flag)."""
        name = (lambda n: f"--{n.replace('_', '-')}") if flags else (lambda n: n)
        if not (isinstance(self.repetition, (int, float)) and math.isfinite(self.repetition) and self.repetition > 0):
            raise InputError(f"{name('repetition_penalty')} {self.repetition} must be a finite number > 0 (1 = none).")
        for what, v in (("presence_penalty", self.presence), ("frequency_penalty", self.frequency)):
            if not (isinstance(v, (int, float)) and -PENALTY_LIMIT <= v <= PENALTY_LIMIT):
                raise InputError(f"{name(what)} {v} must be in [-2, 2] (0 = none).")
        for tok, v in self.bias:
            if vocab_size is not None and not 0 <= tok < vocab_size:
                raise InputError(f"logit_bias names token {tok}; token ids are in [0, {vocab_size}).")
            if not -BIAS_LIMIT <= v <= BIAS_LIMIT:
                raise InputError(f"logit_bias for token {tok} is {v}; a bias is in [-100, 100].")


class History:
    """``seen (B, V)`` bool and ``count (B, V)`` float32 of a batch of sequences (module docstring).

    Args:
        prompts: ``(B, T)`` token ids, or a list of ``B`` id lists.
        vocab_size: ``V``.
        mask: ``(B, T)`` 1 for tokens, 0 for padding (padding is not a token the sequence holds).
    """

    def __init__(self, prompts, vocab_size: int, mask: Tensor | None = None):
        if not isinstance(prompts, Tensor):
            prompts = [torch.as_tensor(p, dtype=torch.long) for p in prompts]
            width = max(len(p) for p in prompts)
            mask = torch.stack([torch.arange(width) < len(p) for p in prompts])
            prompts = torch.stack([torch.nn.functional.pad(p, (0, width - len(p))) for p in prompts])
        B = prompts.shape[0]
        self.seen = torch.zeros(B, vocab_size, dtype=torch.bool, device=prompts.device)
        keep = torch.ones_like(prompts, dtype=torch.bool) if mask is None else mask.bool()
        rows = torch.arange(B, device=prompts.device)[:, None].expand_as(prompts)           # (B, T)
        self.seen[rows[keep], prompts[keep]] = True
        self.count = torch.zeros(B, vocab_size, dtype=torch.float32, device=prompts.device)

    def add(self, tokens: Tensor) -> None:
        """Record one new token per row, ``tokens (B,)``."""
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        self.seen[rows, tokens] = True
        self.count[rows, tokens] += 1

    @classmethod
    def stack(cls, parts: list["History"]) -> "History":
        """One history of the rows of ``parts``, in order (the server gathers the rows of one step)."""
        out = cls.__new__(cls)
        out.seen, out.count = torch.cat([h.seen for h in parts]), torch.cat([h.count for h in parts])
        return out


def penalize(logits: Tensor, history: History, penalties: list[Penalties]) -> Tensor:
    """``logits (B, V)`` with each row's ``penalties[b]`` applied (module docstring); a new float32 tensor.

    One penalty for every row, or one per row (the server batches sequences with different options).
    """
    logits = logits.float()
    B = logits.shape[0]
    if len(penalties) == 1 and B > 1:
        penalties = penalties * B
    col = lambda vals: torch.tensor(vals, dtype=torch.float32, device=logits.device)[:, None]  # noqa: E731 (B, 1)
    r = col([p.repetition for p in penalties])
    if bool((r != 1).any()):
        repeated = torch.where(logits > 0, logits / r, logits * r)
        logits = torch.where(history.seen, repeated, logits)
    presence, frequency = col([p.presence for p in penalties]), col([p.frequency for p in penalties])
    if bool((presence != 0).any() or (frequency != 0).any()):
        logits = logits - history.count * frequency - (history.count > 0).float() * presence
    for b, p in enumerate(penalties):
        if p.bias:
            ids = torch.tensor([t for t, _ in p.bias], dtype=torch.long, device=logits.device)
            logits[b].index_add_(0, ids, torch.tensor([v for _, v in p.bias], device=logits.device))
    return logits
