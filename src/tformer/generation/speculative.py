"""Speculative decoding: guess ``k`` tokens cheaply, check them all in ONE forward of the model.

A decode step on a CPU reads every weight to produce one token; a forward over ``k + 1`` tokens reads
them once too and costs little more. So a cheap *draft* proposes ``d_1 .. d_k``, the model runs once
over ``[last, d_1, .., d_k]`` (:func:`tformer.generation.step.extend`, written into the KV cache),
and its logits ``z_0 .. z_k`` (``z_i`` predicts the token after ``d_i``, ``d_0 = last``) decide how
many drafts to keep (Leviathan et al., 2023; Chen et al., 2023):

- **greedy**: keep ``d_i`` while ``d_i = argmax z_{i-1}``; at the first mismatch emit
  ``argmax z_{i-1}`` instead; if all ``k`` match, emit the bonus ``argmax z_k``. Exactly the tokens
  of plain greedy decoding (up to the rounding of a ``k + 1``-token forward against a one-token one).
- **sampling** with target distribution ``p_i = softmax(filter(z_i / temperature))`` and draft
  distribution ``q_i`` (a point mass at ``d_i`` for a deterministic draft): keep ``d_i`` with
  probability ``min(1, p(d_i) / q(d_i))``; at the first rejection draw from the residual
  ``norm(max(0, p - q))``; if all are kept, draw the bonus from ``p_k``. Each emitted token is then
  distributed exactly as ``p`` (the theorem of both papers: ``P(x) = q(x) min(1, p/q) +
  (1 - sum_y min(p, q)) · max(0, p - q)(x) / sum max(0, p - q) = min(p, q) + max(0, p - q) = p(x)``).

Each step emits between 1 and ``k + 1`` tokens; the cache keeps ``last`` and the accepted drafts and
forgets the rest (``state.truncate``). Drafts here:

- :func:`lookup_draft` (prompt lookup, n-gram): the ``k`` tokens that followed the most recent earlier
  occurrence of the sequence's last ``n`` tokens. No second model; it wins where the answer copies
  the prompt (summaries, rewrites, code edits) and costs one wasted slot of the forward elsewhere.
- a draft *model* (e.g. the same model in a 4-bit format, ``tformer.set_precision(copy,
  "q4_0")``) through :func:`generate_speculative`'s ``draft_model``, sampling ``q`` itself.

The server (:mod:`tformer.serve.scheduler`) and :func:`generate_speculative` call the same
:func:`lookup_draft`, :func:`accept_greedy` and :func:`accept_sampled`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tformer.errors import InputError
from tformer.generation.sampling import check_sampling, is_greedy, probabilities
from tformer.generation.step import extend, prefill

Tensor = torch.Tensor


def lookup_draft(tokens: list[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """The ``k`` tokens that followed the latest earlier occurrence of the last ``n`` tokens of
    ``tokens`` (``n`` from ``max_ngram`` down to ``min_ngram``, the longest match first); ``[]`` when
    none occurs. When the occurrence is so recent that fewer than ``k`` tokens follow it, the text
    since it is taken to repeat (a loop of period ``P`` continues with period ``P``).
    ``O(len(tokens) · max_ngram)`` per call."""
    L = len(tokens)
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        tail = tokens[L - n:]
        for start in range(L - n - 1, -1, -1):                # latest occurrence first, not the tail itself
            if tokens[start:start + n] == tail:
                period = L - n - start                         # the tail repeats what began `period` earlier
                return [tokens[start + n + i - period * ((start + n + i - L) // period + 1)]
                        if start + n + i >= L else tokens[start + n + i] for i in range(k)]
    return []


def accept_greedy(logits: Tensor, draft: list[int]) -> list[int]:
    """Greedy verification: ``logits (k+1, V)`` of the forward over ``[last] + draft``. Returns the
    accepted drafts and then the model's own next token (1 to ``k + 1`` tokens)."""
    best = logits.argmax(dim=-1).tolist()                                    # (k+1,) one host transfer
    out = []
    for d, b in zip(draft, best):
        if d != b:
            break
        out.append(d)
    out.append(best[len(out)])
    return out


def accept_sampled(probs: Tensor, draft: list[int], generator: torch.Generator | None = None,
                   draft_probs: Tensor | None = None) -> list[int]:
    """Speculative sampling's accept / reject rule (module docstring).

    Args:
        probs: ``(k+1, V)`` target distributions ``p_0 .. p_k`` after ``[last] + draft``.
        draft: the ``k`` drafted tokens.
        generator: the sequence's random generator (uniforms, then one residual or bonus draw).
        draft_probs: ``(k, V)`` the draft's distributions ``q_i`` the drafts were drawn from;
            ``None``: a deterministic draft (``q_i`` a point mass at ``d_i``).
    Returns:
        the accepted drafts and one more token (1 to ``k + 1`` tokens), each distributed as ``p``.
    """
    k = len(draft)
    d = torch.tensor(draft, dtype=torch.long)
    p_d = probs[torch.arange(k), d]                                          # (k,) p_i(d_i)
    q_d = torch.ones(k) if draft_probs is None else draft_probs[torch.arange(k), d]
    u = torch.rand(k, generator=generator)
    keep = (u * q_d < p_d).tolist()                                          # u < p/q without dividing by 0
    j = keep.index(False) if False in keep else k
    if j == k:
        residual = probs[k]                                                  # every draft kept: the bonus
    else:
        q = torch.zeros_like(probs[j]) if draft_probs is None else draft_probs[j]
        if draft_probs is None:
            q[d[j]] = 1.0
        residual = (probs[j] - q).clamp(min=0)
        if not residual.sum() > 0:                                           # p == q up to rounding
            residual = probs[j]
    new = int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return draft[:j] + [new]


def accept(logits: Tensor, draft: list[int], temperature: float = 0.0, top_k: int | None = None,
           top_p: float | None = None, generator: torch.Generator | None = None,
           draft_probs: Tensor | None = None) -> list[int]:
    """:func:`accept_greedy` for a greedy temperature, :func:`accept_sampled` on the target
    distributions otherwise; ``logits (k+1, V)``."""
    if is_greedy(temperature):
        return accept_greedy(logits, draft)
    return accept_sampled(probabilities(logits, temperature, top_k, top_p), draft, generator, draft_probs)


@dataclass
class SpeculativeStats:
    """What a speculative generation did: forwards after the prefill (``forwards``), those that
    verified drafts (``steps``), drafted and accepted tokens."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    forwards: int = 0

    @property
    def acceptance(self) -> float:
        """Accepted drafts over drafted ones (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    def add(self, drafted: int, emitted: int) -> None:
        self.steps += 1
        self.drafted += drafted
        self.accepted += emitted - 1


@torch.inference_mode()
def generate_speculative(model, ids: Tensor, max_new_tokens: int, *, k: int = 4, temperature: float = 0.0,
                         top_k: int | None = None, top_p: float | None = None,
                         generator: torch.Generator | None = None, eos: int | list[int] | None = None,
                         draft_model=None, max_ngram: int = 3) -> tuple[list[int], SpeculativeStats]:
    """Generate up to ``max_new_tokens`` after ``ids (1, T)`` with ``k`` drafted tokens per forward.

    The draft is prompt lookup (:func:`lookup_draft`), or ``draft_model`` (a cheaper copy of the
    model, e.g. 4-bit) sampling its own ``q`` (greedily when ``temperature`` is greedy). Steps without
    any lookup draft decode one token, as plain generation does. Stops after an ``eos`` token (kept).

    Returns:
        ``(new tokens, SpeculativeStats)``.
    Raises:
        InputError: for a batch other than 1, ``k < 1`` or bad sampling options.
    """
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise InputError(f"speculative decoding generates one sequence: ids must be (1, T), got {tuple(ids.shape)}.")
    if k < 1:
        raise InputError(f"k={k} drafted tokens per step must be >= 1.")
    check_sampling(temperature, top_k, top_p)
    stops = set([eos] if isinstance(eos, int) else (eos or []))
    seq = ids[0].tolist()
    max_len = len(seq) + max_new_tokens + k + 1
    state = model.new_state(1, max_len)
    first = prefill(model, ids, state)                                       # (1, V)
    out = [_pick(first, temperature, top_k, top_p, generator)]
    stats = SpeculativeStats()
    drafter = ModelDraft(draft_model, max_len) if draft_model is not None else None
    while len(out) < max_new_tokens and out[-1] not in stops:
        history = seq + out                                                  # the state holds all but the last
        room = max_new_tokens - len(out)
        draft_probs = None
        if drafter is not None:
            draft, draft_probs = drafter.propose(history, min(k, room), temperature, top_k, top_p, generator)
        else:
            draft = lookup_draft(history, min(k, room), max_ngram)
        n = len(history) - 1
        logits = extend(model, torch.tensor([[history[-1]] + draft]), state)[0]     # (len(draft)+1, V)
        new = accept(logits, draft, temperature, top_k, top_p, generator, draft_probs) if draft else \
            [_pick(logits[-1:], temperature, top_k, top_p, generator)]
        state.truncate(n + len(new))                                         # last + the accepted drafts
        stats.forwards += 1
        if draft:
            stats.add(len(draft), len(new))
        for t in new:
            out.append(t)
            if t in stops or len(out) >= max_new_tokens:
                break
    return out, stats


def _pick(logits: Tensor, temperature: float, top_k, top_p, generator) -> int:
    """One token from ``logits (1, V)`` as plain generation picks it."""
    if is_greedy(temperature):
        return int(logits[0].argmax())
    return int(torch.multinomial(probabilities(logits, temperature, top_k, top_p)[0], 1, generator=generator))


class ModelDraft:
    """A draft model with its own cache, kept in step with the accepted sequence.

    The cache remembers which tokens it holds, so each :meth:`propose` feeds the draft only what
    follows the longest prefix it shares with the history: after a verification, the accepted
    tokens after the drafts it kept; for another sequence (the server keeps one draft cache for
    whichever sequence speculates, :mod:`tformer.serve.scheduler`), what follows the prompt prefix
    both share (a chat template's system prompt), not the whole prompt.

    Args:
        model: the draft (e.g. the target model at a 4-bit format).
        max_len: positions its cache holds (the sequence's prompt, new tokens and ``k + 1`` more).
    """

    def __init__(self, model, max_len: int):
        self.model, self.state = model, model.new_state(1, max_len)
        self.tokens: list[int] = []                                          # what the cache holds, in order

    @property
    def max_len(self) -> int:
        return self.state.max_len

    def propose(self, history: list[int], k: int, temperature, top_k=None, top_p=None, generator=None):
        """``k`` drafted tokens after ``history`` and the distributions ``(k, V)`` they came from
        (point masses when greedy)."""
        n, limit = 0, min(len(self.tokens), len(history) - 1)               # the last token is always fed
        while n < limit and self.tokens[n] == history[n]:
            n += 1
        self.state.truncate(n)                                              # forget what the history does not share
        del self.tokens[n:]
        logits = extend(self.model, torch.tensor([history[n:]]), self.state)[0, -1:]   # (1, V)
        self.tokens += history[n:]
        draft, qs = [], []
        for i in range(k):
            if is_greedy(temperature):
                q = torch.zeros(logits.shape[-1])
                q[logits[0].argmax()] = 1.0
            else:
                q = probabilities(logits, temperature, top_k, top_p)[0]
            t = int(torch.multinomial(q, 1, generator=generator)) if not is_greedy(temperature) else int(q.argmax())
            draft.append(t)
            qs.append(q)
            if i + 1 < k:
                logits = extend(self.model, torch.tensor([[t]]), self.state)[0]   # (1, V)
                self.tokens.append(t)
        return draft, torch.stack(qs)
