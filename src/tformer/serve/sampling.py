"""The scheduler's token choice for a whole batch: each row with its own options, one host transfer.

Rows differ in temperature, top-k, top-p, min-p, seed and whether they want log-probabilities. Greedy rows
(temperature 0, or below ``MIN_TEMPERATURE``) take the argmax of their logits; rows that sample are grouped by their options and drawn with
:func:`tformer.generation.sampling.sample`, each row from its own random generator, so a seeded
request gets the same tokens alone or in any batch. Penalties and ``logit_bias`` are applied to the rows before (``Scheduler._penalize``). Everything stays in tensors until ONE
``.tolist()`` brings the tokens (and, when some row asks, their log-probabilities) to Python.
"""

from __future__ import annotations

import torch

from tformer.generation.sampling import is_greedy, sample

Tensor = torch.Tensor


def choose(logits: Tensor, params: list, generators: list[torch.Generator]) -> list[tuple]:
    """Next token of every row of ``logits (b, vocab)`` under ``params[i]`` (a scheduler ``Params``).

    Returns ``b`` tuples ``(token, logprob, top)``: ``logprob = log softmax(logits)[token]`` and
    ``top`` the ``params[i].logprobs`` most likely ``(token, logprob)`` pairs, both ``None`` for rows
    that did not ask.
    """
    logits = logits.float()                                                  # (b, V)
    picked = logits.argmax(dim=-1)                                           # (b,) greedy; sampled rows overwrite
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        if not is_greedy(p.temperature):
            groups.setdefault((p.temperature, p.top_k, p.top_p if p.top_p < 1 else None, p.min_p or None), []).append(i)
    for (temperature, top_k, top_p, min_p), rows in groups.items():
        picked[rows] = sample(logits[rows], temperature, top_k, top_p, [generators[i] for i in rows], min_p)
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not want:
        return [(t, None, None) for t in picked.tolist()]
    logp = torch.log_softmax(logits[want], dim=-1)                           # (w, V)
    chosen = logp.gather(1, picked[want, None])                              # (w, 1)
    k = min(max(params[i].logprobs for i in want), logp.shape[-1])
    top_v, top_i = logp.topk(k, dim=-1)                                      # (w, k) best first
    flat = torch.cat([picked.double(), chosen[:, 0].double(), top_i.flatten().double(), top_v.flatten().double()])
    values = flat.tolist()                                                   # the one host transfer
    b, w = len(params), len(want)
    tokens = [int(t) for t in values[:b]]
    lps, ti, tv = values[b:b + w], values[b + w:b + w + w * k], values[b + w + w * k:]
    out = [(t, None, None) for t in tokens]
    for j, i in enumerate(want):
        n = params[i].logprobs
        top = [(int(ti[j * k + r]), tv[j * k + r]) for r in range(n)] if n else None
        out[i] = (tokens[i], lps[j], top)
    return out
