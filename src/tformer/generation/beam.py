"""Decoding a sequence-to-sequence model: greedy, sampling and beam search, batched.

Any model with this interface decodes here (the transformer :mod:`tformer.models.seq2seq` and the
RNNs of :mod:`tformer.models.rnn_seq2seq`):

    state = model.new_state(src, src_mask, max_len)   # encodes once; per-request state
    logits = model.decode_step(tokens, state)         # (B, T) -> (B, T, V), advances the state
    state.repeat(k); state.reorder(index, rows)       # beam search: k rows per source; copy rows in place

Beam search (Graves, 2012; Sutskever et al., 2014) keeps the ``num_beams`` best prefixes by summed
log-probability. A prefix that picks EOS among the top ``num_beams`` candidates becomes a finished
hypothesis scored ``sum log p / n ** length_penalty`` (``n`` = generated tokens, EOS included:
``length_penalty`` > 0 favours longer outputs, 0 is the raw sum). Each source keeps its
``num_beams`` best hypotheses and closes when they are full and (``early_stopping``):

- ``True``: at once;
- ``False``: the best open prefix, scored at its current length, cannot beat the worst hypothesis;
- ``"never"``: the same bound at the longest length allowed when ``length_penalty`` > 0, which
  is exact (a prefix's sum only falls), so with enough beams the search is exhaustive.

These are the rules of HuggingFace ``generate`` (transformers 4.50+), so the outputs agree token
for token (tests/interop/test_seq2seq_hf.py). ``forced_eos`` is HF's ``forced_eos_token_id`` (on by
default in Marian and BART configs): the step that makes the ``max_new_tokens``-th token allows that
token only, with log-probability 0, so every output that reaches the limit ends with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tformer.errors import InputError
from tformer.generation.generate import check_sampling, sample

Tensor = torch.Tensor


@dataclass
class Hypothesis:
    """A finished output: ``tokens`` (generated ids, EOS included when reached) and ``score``."""

    tokens: list[int]
    score: float


def _check(src: Tensor, max_new_tokens: int) -> None:
    if src.dim() != 2 or src.shape[1] == 0:
        raise InputError(f"src must be a non-empty (batch, length) id tensor, got shape {tuple(src.shape)}.")
    if max_new_tokens < 1:
        raise InputError(f"max_new_tokens={max_new_tokens} must be at least 1.")


def force(logp: Tensor, token: int) -> Tensor:
    """``logp (N, V)`` with every token but ``token`` at -inf and ``token`` at 0 (HF's forced EOS)."""
    out = torch.full_like(logp, float("-inf"))
    out[:, token] = 0.0
    return out


@torch.no_grad()
def sample_decode(model, src: Tensor, src_mask: Tensor | None = None, *, bos: int, eos: int,
                  max_new_tokens: int = 64, temperature: float = 0.0, top_k: int | None = None,
                  top_p: float | None = None, seed: int | None = None,
                  forced_eos: int | None = None) -> list[list[int]]:
    """Greedy (``temperature=0``) or ancestral sampling, one token at a time for the whole batch;
    ``forced_eos``: the ``max_new_tokens``-th token is this one (module docstring).

    Returns:
        per source, the generated ids up to and including EOS (or ``max_new_tokens`` of them).
    """
    _check(src, max_new_tokens)
    check_sampling(temperature, top_k, top_p)
    B = src.shape[0]
    gens = None
    if seed is not None:  # one generator per row, all seeded alike: a batched result equals each source alone
        gens = [torch.Generator(device=src.device).manual_seed(seed) for _ in range(B)]
    state = model.new_state(src, src_mask, max_len=max_new_tokens + 1)
    tokens = torch.full((B, 1), bos, dtype=torch.long, device=src.device)
    out: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    for n in range(1, max_new_tokens + 1):
        logits = model.decode_step(tokens, state)[:, -1]                                 # (B, V)
        if forced_eos is not None and n == max_new_tokens:
            logits = force(logits.float(), forced_eos)
        tokens = sample(logits, temperature, top_k, top_p, gens)[:, None]                # (B, 1)
        for b, t in enumerate(tokens[:, 0].tolist()):                                    # the step's one host sync
            if not done[b]:
                out[b].append(t)
                done[b] = t == eos
        if all(done):
            break
    return out


def greedy(model, src: Tensor, src_mask: Tensor | None = None, *, bos: int, eos: int,
           max_new_tokens: int = 64, forced_eos: int | None = None) -> list[list[int]]:
    """The most likely next token at every step (see :func:`sample_decode`)."""
    return sample_decode(model, src, src_mask, bos=bos, eos=eos, max_new_tokens=max_new_tokens, forced_eos=forced_eos)


@torch.no_grad()
def beam_search(model, src: Tensor, src_mask: Tensor | None = None, *, bos: int, eos: int,
                num_beams: int = 4, max_new_tokens: int = 64, length_penalty: float = 1.0,
                early_stopping: bool | str = False, n_best: int = 1,
                forced_eos: int | None = None) -> list[list[Hypothesis]]:
    """Batched beam search.

    Args:
        model: see the module docstring; src ``(B, S)``, src_mask ``(B, S)`` 1 = token.
        bos, eos: the decoder's start token and the end token.
        num_beams: prefixes kept per source (1 = greedy).
        max_new_tokens: the most tokens generated; prefixes still open then are finished there.
        length_penalty: the exponent of the length in the hypothesis score.
        early_stopping: ``True``, ``False`` or ``"never"`` (module docstring).
        n_best: hypotheses returned per source, best first (at most ``num_beams``).
        forced_eos: HF's ``forced_eos_token_id``: the last allowed step picks this token only.
    Returns:
        ``B`` lists of ``n_best`` :class:`Hypothesis`.
    """
    _check(src, max_new_tokens)
    if not 1 <= n_best <= num_beams:
        raise InputError(f"n_best={n_best} must be between 1 and num_beams={num_beams}.")
    if early_stopping not in (True, False, "never"):
        raise InputError(f"early_stopping={early_stopping!r} must be True, False or 'never'.")
    B, K, dev = src.shape[0], num_beams, src.device
    state = model.new_state(src, src_mask, max_len=max_new_tokens + 1).repeat(K)        # rows b*K .. b*K+K-1
    last = torch.full((B, K), bos, dtype=torch.long, device=dev)                          # (B, K) newest tokens
    prefixes = [[[] for _ in range(K)] for _ in range(B)]                                 # host: tokens after BOS
    scores = torch.full((B, K), float("-inf"), device=dev)
    scores[:, 0] = 0.0                                                                    # one live beam at first
    finished: list[list[Hypothesis]] = [[] for _ in range(B)]
    closed = [False] * B
    for n in range(1, max_new_tokens + 1):                                                # n = tokens after this step
        logp = F.log_softmax(model.decode_step(last.reshape(B * K, 1), state)[:, -1].float(), -1)   # (B·K, V)
        if forced_eos is not None and n == max_new_tokens:
            logp = force(logp, forced_eos)
        V = logp.shape[-1]
        total = (scores[:, :, None] + logp.view(B, K, V)).view(B, K * V)                  # (B, K·V)
        top, index = total.topk(min(2 * K, K * V), dim=-1)                                # (B, 2K), sorted
        beam, token = index // V, index % V
        ends = (token == eos) | (n == max_new_tokens)                                     # these stop here
        live = top.masked_fill(ends, float("-inf")).topk(K, dim=-1)                       # best K open prefixes
        src_beam, last = beam.gather(1, live.indices), token.gather(1, live.indices)      # (B, K)
        scores = live.values
        C = top.shape[1]
        host = torch.cat([top.double(), beam.double(), token.double(), ends.double(), src_beam.double(),
                          last.double(), scores[:, :1].double()], 1).tolist()             # the step's one host sync
        for b, row in enumerate(host):
            tops, beams, toks, end = row[:C], row[C:2 * C], row[2 * C:3 * C], row[3 * C:4 * C]
            picks, nexts = row[4 * C:4 * C + K], row[4 * C + K:4 * C + 2 * K]
            if not closed[b]:
                for r in range(min(K, C)):                                                # only the top K may finish
                    if end[r] and tops[r] > float("-inf"):
                        seq = prefixes[b][int(beams[r])] + [int(toks[r])]
                        _add(finished[b], Hypothesis(seq, tops[r] / n ** length_penalty), K)
            prefixes[b] = [prefixes[b][int(p)] + [int(t)] for p, t in zip(picks, nexts)]
            horizon = max_new_tokens if (early_stopping == "never" and length_penalty > 0) else n
            if not closed[b] and len(finished[b]) == K and (
                    early_stopping is True or row[-1] / horizon ** length_penalty <= finished[b][-1].score):
                closed[b] = True
        if all(closed):
            break
        picks = [b * K + int(p) for b, row in enumerate(host) for p in row[4 * C:4 * C + K]]
        moved = [i for i, p in enumerate(picks) if p != i]                                # rows whose prefix changed
        if moved:
            state.reorder(torch.tensor([picks[i] for i in moved], device=dev), torch.tensor(moved, device=dev))
    return [hyps[:n_best] for hyps in finished]


def _add(hyps: list[Hypothesis], h: Hypothesis, k: int) -> None:
    """Insert ``h`` into ``hyps`` (sorted, best first), keeping the best ``k``."""
    if len(hyps) == k and h.score <= hyps[-1].score:
        return
    hyps.append(h)
    hyps.sort(key=lambda x: -x.score)
    del hyps[k:]
