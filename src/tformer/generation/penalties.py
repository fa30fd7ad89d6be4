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

:class:`History` keeps ``seen`` and ``count`` as ``(B, V)`` tensors updated once per token, and each
row's penalties as tensors made once when the row starts (factors ``(B, 1)``, the bias a ``(B, V)`` row), so
a step is a few tensor ops, O(B·V) whatever the length and whatever mix of options the rows have. Used by
:func:`tformer.generation.generate.generate_tokens` and the server's scheduler (one row per KV slot).
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
    """``seen (B, V)`` bool and ``count (B, V)`` float32 of a batch of sequences (module docstring), and
    each row's :class:`Penalties` as tensors: ``repetition``, ``presence``, ``frequency`` ``(B, 1)``, ``bias (B, V)``.

    Args:
        prompts: ``(B, T)`` token ids, or a list of ``B`` id lists.
        vocab_size: ``V``.
        mask: ``(B, T)`` 1 for tokens, 0 for padding (padding is not a token the sequence holds).
        penalties: one for every row, or one per row.
    """

    def __init__(self, prompts, vocab_size: int, mask: Tensor | None = None,
                 penalties: Penalties | list[Penalties] = Penalties()):
        if not isinstance(prompts, Tensor):
            prompts = [torch.as_tensor(p, dtype=torch.long) for p in prompts]
            width = max(len(p) for p in prompts)
            mask = torch.stack([torch.arange(width) < len(p) for p in prompts])
            prompts = torch.stack([torch.nn.functional.pad(p, (0, width - len(p))) for p in prompts])
        B, device = prompts.shape[0], prompts.device
        self._empty(B, vocab_size, device)
        keep = torch.ones_like(prompts, dtype=torch.bool) if mask is None else mask.bool()
        rows = torch.arange(B, device=device)[:, None].expand_as(prompts)           # (B, T)
        self.seen[rows[keep], prompts[keep]] = True
        for b, p in enumerate(penalties if isinstance(penalties, list) else [penalties] * B):
            self._set(b, p)

    def _empty(self, B: int, vocab_size: int, device) -> None:
        self.seen = torch.zeros(B, vocab_size, dtype=torch.bool, device=device)
        self.count = torch.zeros(B, vocab_size, dtype=torch.float32, device=device)
        self.repetition = torch.ones(B, 1, device=device)
        self.presence, self.frequency = torch.zeros(B, 1, device=device), torch.zeros(B, 1, device=device)
        self.bias = torch.zeros(B, vocab_size, device=device)
        # which terms any row has used: the others are skipped (applied with neutral values they change nothing)
        self.uses_repetition = self.uses_counts = self.uses_bias = False

    @classmethod
    def rows(cls, n: int, vocab_size: int, device=None) -> "History":
        """``n`` empty rows (the server's KV slots), each made ready by :meth:`start`."""
        out = cls.__new__(cls)
        out._empty(n, vocab_size, device)
        return out

    def start(self, row: int, prompt: list[int], penalties: Penalties) -> None:
        """Row ``row`` now holds a new sequence: ``prompt`` seen, nothing generated, its ``penalties``."""
        self.seen[row] = False
        self.seen[row, torch.as_tensor(prompt, dtype=torch.long, device=self.seen.device)] = True
        self.count[row] = 0
        self._set(row, penalties)

    def _set(self, row: int, p: Penalties) -> None:
        self.repetition[row], self.presence[row], self.frequency[row] = p.repetition, p.presence, p.frequency
        self.bias[row] = 0
        if p.bias:                                                 # a repeated token's biases add up
            ids = torch.tensor([t for t, _ in p.bias], dtype=torch.long, device=self.bias.device)
            self.bias[row].index_add_(0, ids, torch.tensor([v for _, v in p.bias], device=self.bias.device))
        self.uses_repetition |= p.repetition != 1.0
        self.uses_counts |= bool(p.presence or p.frequency)
        self.uses_bias |= bool(p.bias)

    def add(self, tokens: Tensor, rows: Tensor | None = None) -> None:
        """Record one new token per row, ``tokens (B,)`` (or one for each of ``rows``)."""
        if rows is None:
            rows = torch.arange(tokens.shape[0], device=tokens.device)
        self.seen[rows, tokens] = True
        self.count[rows, tokens] += 1


def penalize(logits: Tensor, history: History, rows: Tensor | None = None) -> Tensor:
    """``logits (B, V)`` with each row's penalties applied (module docstring), as float32; ``rows``: the
    history's rows that ``logits``' rows are (the server's slots), else all of them in order."""
    pick = (lambda t: t) if rows is None else (lambda t: t[rows])     # noqa: E731
    logits = logits.float()
    if history.uses_repetition:
        r = pick(history.repetition)
        logits = torch.where(pick(history.seen), torch.where(logits > 0, logits / r, logits * r), logits)
    if history.uses_counts:
        count = pick(history.count)
        logits = logits - count * pick(history.frequency) - (count > 0).float() * pick(history.presence)
    if history.uses_bias:
        logits = logits + pick(history.bias)
    return logits
