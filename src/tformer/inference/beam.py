"""Decoding a sequence-to-sequence model: greedy, sampling and beam search, batched.

Any model with this interface decodes here (the transformer :mod:`tformer.models.seq2seq` and the
RNNs of :mod:`tformer.models.rnn_seq2seq`):

    state = model.new_state(src, src_mask, max_len)   # encodes once; per-request state
    logits = model.decode_step(tokens, state)         # (B, T) -> (B, T, V), advances the state
    state.repeat(k); state.reorder(index)             # beam search: k rows per source; pick rows

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
for token (tests/test_seq2seq_hf.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tformer.errors import InputError
from tformer.inference.generate import check_sampling, sample

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


@torch.no_grad()
def sample_decode(model, src: Tensor, src_mask: Tensor | None = None, *, bos: int, eos: int,
                  max_new_tokens: int = 64, temperature: float = 0.0, top_k: int | None = None,
                  top_p: float | None = None, seed: int | None = None) -> list[list[int]]:
    """Greedy (``temperature=0``) or ancestral sampling, one token at a time for the whole batch.

    Returns:
        per source, the generated ids up to and including EOS (or ``max_new_tokens`` of them).
    """
    _check(src, max_new_tokens)
    check_sampling(temperature, top_k, top_p)
    B = src.shape[0]
    gens = None
    if seed is not None:
        gens = [torch.Generator(device=src.device).manual_seed(seed + i) for i in range(B)]
    state = model.new_state(src, src_mask, max_len=max_new_tokens + 1)
    tokens = torch.full((B, 1), bos, dtype=torch.long, device=src.device)
    out = [[] for _ in range(B)]
    done = torch.zeros(B, dtype=torch.bool, device=src.device)
    for _ in range(max_new_tokens):
        logits = model.decode_step(tokens, state)[:, -1]                                 # (B, V)
        tokens = sample(logits, temperature, top_k, top_p, gens)[:, None]                # (B, 1)
        for b in (~done).nonzero().flatten().tolist():
            out[b].append(int(tokens[b]))
        done |= tokens[:, 0] == eos
        if bool(done.all()):
            break
    return out


def greedy(model, src: Tensor, src_mask: Tensor | None = None, *, bos: int, eos: int,
           max_new_tokens: int = 64) -> list[list[int]]:
    """The most likely next token at every step (see :func:`sample_decode`)."""
    return sample_decode(model, src, src_mask, bos=bos, eos=eos, max_new_tokens=max_new_tokens)


@torch.no_grad()
def beam_search(model, src: Tensor, src_mask: Tensor | None = None, *, bos: int, eos: int,
                num_beams: int = 4, max_new_tokens: int = 64, length_penalty: float = 1.0,
                early_stopping: bool | str = False, n_best: int = 1) -> list[list[Hypothesis]]:
    """Batched beam search.

    Args:
        model: see the module docstring; src ``(B, S)``, src_mask ``(B, S)`` 1 = token.
        bos, eos: the decoder's start token and the end token.
        num_beams: prefixes kept per source (1 = greedy).
        max_new_tokens: the most tokens generated; prefixes still open then are finished there.
        length_penalty: the exponent of the length in the hypothesis score.
        early_stopping: ``True``, ``False`` or ``"never"`` (module docstring).
        n_best: hypotheses returned per source, best first (at most ``num_beams``).
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
    prefixes = torch.full((B, K, 1), bos, dtype=torch.long, device=dev)                   # (B, K, n)
    scores = torch.full((B, K), float("-inf"), device=dev)
    scores[:, 0] = 0.0                                                                    # one live beam at first
    finished: list[list[Hypothesis]] = [[] for _ in range(B)]
    closed = [False] * B
    for n in range(1, max_new_tokens + 1):                                                # n = tokens after this step
        logp = F.log_softmax(model.decode_step(prefixes[:, :, -1].reshape(B * K, 1), state)[:, -1].float(), -1)
        V = logp.shape[-1]
        total = (scores[:, :, None] + logp.view(B, K, V)).view(B, K * V)                  # (B, K·V)
        top, index = total.topk(min(2 * K, K * V), dim=-1)                                # (B, 2K), sorted
        beam, token = index // V, index % V
        ends = (token == eos) | (n == max_new_tokens)                                     # these stop here
        for b in range(B):
            if closed[b]:
                continue
            for r in range(min(K, top.shape[1])):                                         # only the top K may finish
                if ends[b, r] and top[b, r] > float("-inf"):
                    seq = prefixes[b, beam[b, r], 1:].tolist() + [int(token[b, r])]
                    _add(finished[b], Hypothesis(seq, float(top[b, r]) / n ** length_penalty), K)
        live = top.masked_fill(ends, float("-inf")).topk(K, dim=-1)                       # best K open prefixes
        src_beam, next_token = beam.gather(1, live.indices), token.gather(1, live.indices)  # (B, K)
        scores = live.values
        prefixes = torch.cat([prefixes.gather(1, src_beam[:, :, None].expand_as(prefixes)),
                              next_token[:, :, None]], dim=-1)
        state.reorder((src_beam + K * torch.arange(B, device=dev)[:, None]).flatten())
        horizon = max_new_tokens if (early_stopping == "never" and length_penalty > 0) else n
        for b in range(B):
            full = len(finished[b]) == K
            if full and (early_stopping is True
                         or float(scores[b, 0]) / horizon ** length_penalty <= finished[b][-1].score):
                closed[b] = True
        if all(closed):
            break
    return [hyps[:n_best] for hyps in finished]


def _add(hyps: list[Hypothesis], h: Hypothesis, k: int) -> None:
    """Insert ``h`` into ``hyps`` (sorted, best first), keeping the best ``k``."""
    if len(hyps) == k and h.score <= hyps[-1].score:
        return
    hyps.append(h)
    hyps.sort(key=lambda x: -x.score)
    del hyps[k:]
