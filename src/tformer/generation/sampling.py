"""Choosing the next token from logits: greedy, top-k, nucleus (top-p), min-p and temperature.

    logits (B, V) -> keep the top-k -> keep the smallest set of mass top_p -> keep p >= min_p * p_max
        -> / temperature -> softmax -> one draw per row (its own generator) -> (B,) token ids

The filters run in llama.cpp's order (its default chain: top-k, top-p, min-p, then temperature), so
top-p's mass and min-p's ratio are those of the model's own distribution, whatever the temperature;
a temperature then only reshapes what survived. (transformers divides first, so its top-p at
temperature 0.7 keeps fewer tokens than llama.cpp's.) Penalties and ``logit_bias`` come before all
of this (:mod:`tformer.generation.penalties`).

Temperature 0 (or below ``MIN_TEMPERATURE``) is the argmax. Each row may have its own ``torch.Generator``, so a seeded row draws
the same tokens alone or in any batch. Used by :func:`tformer.generation.generate.generate`, beam
search's sampling decode and the server's batched token choice (``tformer.serve.sampling``).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from tformer.errors import InputError

Tensor = torch.Tensor

# Temperatures below this are greedy. Sampling divides the logits by the temperature; a denormal one
# (1e-45) turns them into inf and the softmax into NaN. Below 1e-6 a float32 logit gap that moves the
# choice at all is under the logits' own rounding (about 1e-6 of their size), so the argmax is what
# sampling would pick.
MIN_TEMPERATURE = 1e-6


def is_greedy(temperature: float) -> bool:
    """Whether ``temperature`` (>= 0) means the argmax: 0, or anything below :data:`MIN_TEMPERATURE`."""
    return temperature < MIN_TEMPERATURE


# The seeds a generation takes: torch.Generator.manual_seed's range (a signed 64-bit integer's, OpenAI's too).
SEED_LIMIT = 2**63


def option(name: str, value, flags: bool = False) -> str:
    """How a message names an option and its value: ``top_k=0`` in the API, ``--top-k 0`` (``flags``) on
    the command line."""
    return f"--{name.replace('_', '-')} {value}" if flags else f"{name}={value}"


def check_sampling(temperature: float, top_k: int | None, top_p: float | None, seed: int | None = None, *,
                   min_p: float | None = None, flags: bool = False) -> None:
    """Raise ``InputError`` naming the bad sampling option (as a command-line flag with ``flags``) and its
    valid range: the one check of temperature, top-k, top-p, min-p and the seed, for the API and the commands."""
    leave_out = "leave it out" if flags else "or None"
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
        raise InputError(f"{option('temperature', temperature, flags)} must be a finite number >= 0 (0 = greedy).")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise InputError(f"{option('top_k', top_k, flags)} must be >= 1 ({leave_out} to keep every token).")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0.0 < top_p <= 1.0):
        raise InputError(f"{option('top_p', top_p, flags)} must be in (0, 1] (1 keeps every token).")
    if min_p is not None and not (isinstance(min_p, (int, float)) and 0.0 <= min_p <= 1.0):
        raise InputError(f"{option('min_p', min_p, flags)} must be in [0, 1] (0 keeps every token).")
    if seed is not None and not (isinstance(seed, int) and 0 <= seed < SEED_LIMIT):
        raise InputError(f"{option('seed', seed, flags)} must be an integer in [0, 2**63).")


def check_max_new_tokens(max_new_tokens: int, most: int | None = None, *, flags: bool = False) -> None:
    """Raise ``InputError`` unless ``max_new_tokens`` is an integer >= 0 (and <= ``most`` when given)."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0 or (most is not None and max_new_tokens > most):
        limit = ">= 0" if most is None else f"between 0 and {most:,}"
        raise InputError(f"{option('max_new_tokens', max_new_tokens, flags)} must be {limit}.")


def filter_logits(logits: Tensor, top_k: int | None = None, top_p: float | None = None,
                  min_p: float | None = None) -> Tensor:
    """Set to ``-inf`` every logit outside the top-k, then outside the nucleus of mass ``top_p``, then
    every token whose probability is below ``min_p`` times the most likely one's (min-p: ``l_i < l_max +
    log min_p``, the same ratio whatever the normalisation).

    Args:
        logits: ``(B, V)`` float logits (before the temperature, as llama.cpp filters).
    Returns:
        ``(B, V)`` filtered logits. At least one token per row always survives.
    """
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[:, -1:]                       # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs          # mass of strictly more likely tokens
        drop_sorted = mass_before >= top_p                  # the first token is never dropped
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if min_p:                                               # 0 / None keep everything
        floor = logits.max(dim=-1, keepdim=True).values + math.log(min_p)    # (B, 1)
        logits = logits.masked_fill(logits < floor, float("-inf"))
    return logits


def probabilities(logits: Tensor, temperature: float, top_k: int | None = None, top_p: float | None = None,
                  min_p: float | None = None) -> Tensor:
    """``softmax(filter(logits) / temperature)``, ``(B, V)`` -> ``(B, V)`` float32: the distribution a
    sampled token is drawn from (``temperature`` not greedy)."""
    return torch.softmax(filter_logits(logits.float(), top_k, top_p, min_p) / temperature, dim=-1)


def sample(logits: Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
           generators: Sequence[torch.Generator | None] | None = None, min_p: float | None = None) -> Tensor:
    """Pick one token per row.

    Args:
        logits: ``(B, V)`` next-token logits (penalties and biases already applied).
        temperature: 0 (or below :data:`MIN_TEMPERATURE`) takes the argmax (greedy); otherwise the
            filtered logits are divided by it.
        top_k, top_p, min_p: see :func:`filter_logits`.
        generators: one random generator per row (reproducible, and independent of the batch).
    Returns:
        ``(B,)`` int64 token ids.
    """
    logits = logits.float()
    if is_greedy(temperature):
        return logits.argmax(dim=-1)
    probs = probabilities(logits, temperature, top_k, top_p, min_p)
    if generators is None:
        return torch.multinomial(probs, 1).squeeze(-1)
    return torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators)])
