"""Autoregressive generation: predict the next token, append it, repeat.

With the KV cache (the default) the prompt is run once (the *prefill*, optionally in chunks) and
each later step feeds only the newest token, at its absolute position, attending over the cached
keys and values: O(n) work per token instead of O(n²). ``use_cache=False`` recomputes the whole
window every step (nanoGPT's way); both give the same logits (the tests hold them equal).

Prompts of different lengths are batched with *left* padding and a ``(B, T)`` attention mask of
1 (token) / 0 (padding): every sequence then ends at the same index, so one new column is written
per step. Each sequence gets its own positions (``cumsum(mask) - 1``) and its own random
generator, so a batched result equals generating each prompt alone.

Entry points: :func:`generate` (token ids in, token ids out; the training loop's sampler uses it)
and :func:`generate_tokens` (an iterator over the new tokens). The text API (strings in and out,
stop strings, streaming) is in ``tformer.inference.text``.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Sequence

import torch

from tformer.inference.kv_cache import clear_kv_cache, setup_kv_cache

Tensor = torch.Tensor


# ------------------------------------------------------------------------------------- sampling
def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Raise ``ValueError`` naming the bad sampling option and its valid range."""
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 = greedy).")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k} must be >= 1 (or None to keep every token).")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p} must be in (0, 1] (1 keeps every token).")


def filter_logits(logits: Tensor, top_k: int | None = None, top_p: float | None = None) -> Tensor:
    """Set to ``-inf`` every logit outside the top-k, then outside the nucleus of mass ``top_p``.

    Args:
        logits: ``(B, V)`` float logits (already divided by the temperature).
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
    return logits


def sample(logits: Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
           generators: Sequence[torch.Generator | None] | None = None) -> Tensor:
    """Pick one token per row.

    Args:
        logits: ``(B, V)`` next-token logits.
        temperature: 0 takes the argmax (greedy); otherwise logits are divided by it.
        top_k, top_p: see :func:`filter_logits`.
        generators: one random generator per row (reproducible, and independent of the batch).
    Returns:
        ``(B,)`` int64 token ids.
    """
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(filter_logits(logits / temperature, top_k, top_p), dim=-1)
    if generators is None:
        return torch.multinomial(probs, 1).squeeze(-1)
    return torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators)])


# ---------------------------------------------------------------------------------- the stepper
class _Stepper:
    """Runs the model for generation: ``first()`` prefills, ``next(tokens)`` appends and steps.

    Both return ``(B, vocab)`` logits for the next token. Owns the output buffer ``out (B, total)``
    and the per-sequence padding mask; never reallocates during generation.

    Past the context, ``overflow`` decides what the model sees: ``"window"`` recomputes the last
    ``context_length`` tokens every step (nanoGPT's semantics, O(context) tokens per step);
    ``"shift"`` keeps the last ``context_length // 2`` tokens, prefills them once and goes on with
    the cache (amortised O(1) forward tokens per step; the model sees between half and all of
    the context). With ``use_cache=False`` the same windows are recomputed from scratch.
    """

    def __init__(self, model, ids: Tensor, attention_mask: Tensor | None, max_new_tokens: int,
                 use_cache: bool, prefill_chunk: int | None, overflow: str):
        B, T = ids.shape
        self.model, self.T, self.overflow = model, T, overflow
        self.context = model.config.context_length
        total = T + max_new_tokens
        self.out = torch.empty(B, total, dtype=torch.long, device=ids.device)   # (B, total)
        self.out[:, :T] = ids
        self.cur = T                                       # tokens written to ``out`` so far
        self.offset = 0                                    # ``out`` index of the window's first token
        self.mask = None                                   # (B, total) 1/0, only when there is padding
        if attention_mask is not None and not bool(attention_mask.all()):
            self.mask = torch.ones(B, total, dtype=torch.long, device=ids.device)
            self.mask[:, :T] = attention_mask
        self.chunk = prefill_chunk or T
        self.cache_len = min(total, self.context) if use_cache else 0
        if self.cache_len:
            with torch.inference_mode():
                setup_kv_cache(model, B, self.cache_len)

    def close(self) -> None:
        if self.cache_len:
            clear_kv_cache(self.model)

    def _run(self, start: int, end: int, start_pos: int) -> Tensor:
        """Logits of the token after ``out[:, start:end]``, with ``start_pos`` tokens cached before it."""
        first = start - start_pos                    # ``out`` index of the first key the model sees
        # Positions count from 0 at ``first``: the model derives them from the mask (real tokens
        # only, so left padding shifts nothing) or, without padding, from ``start_pos``.
        mask = self.mask[:, first:end] if self.mask is not None else None
        logits, _ = self.model(self.out[:, start:end], attention_mask=mask, start_pos=start_pos, last_only=True)
        return logits[:, -1]                                                    # (B, vocab)

    @torch.inference_mode()
    def first(self) -> Tensor:
        if not self.cache_len:
            return self._run(0, self.T, 0)
        for s in range(0, self.T, self.chunk):
            logits = self._run(s, min(s + self.chunk, self.T), s)
        return logits

    @torch.inference_mode()
    def next(self, tokens: Tensor) -> Tensor:
        pos = self.cur
        self.out[:, pos] = tokens
        self.cur += 1
        if self.cur - self.offset > self.context:    # the window is full
            if self.overflow == "shift":
                self.offset = self.cur - max(1, self.context // 2)
                return self._run(self.offset, self.cur, 0)      # re-prefill the kept half
            self.offset = self.cur - self.context
        if self.cache_len and (self.overflow == "shift" or self.offset == 0):
            return self._run(pos, pos + 1, pos - self.offset)   # feed one token to the cache
        return self._run(self.offset, self.cur, 0)               # recompute the window


# ------------------------------------------------------------------------------------- ids API
def _check_ids(model, ids: Tensor, attention_mask: Tensor | None, max_new_tokens: int) -> None:
    if not getattr(model.config, "causal", False) or not hasattr(model, "lm_head"):
        raise ValueError(f"generation needs a causal language model (DecoderLM); this is a "
                         f"{type(model).__name__}. For an encoder use `tformer embed` or EncoderModel.encode.")
    if ids.dim() != 2:
        raise ValueError(f"ids must be (batch, seq_len), got shape {tuple(ids.shape)}.")
    if ids.shape[1] == 0 or ids.shape[0] == 0:
        raise ValueError("the prompt is empty; give at least one token (e.g. a start/newline token).")
    context = model.config.context_length
    if ids.shape[1] > context:
        raise ValueError(
            f"the prompt has {ids.shape[1]} tokens but the model's context is {context} "
            f"(config.context_length); shorten the prompt or use a model with a larger context_length.")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0.")
    if attention_mask is not None:
        if attention_mask.shape != ids.shape:
            raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must have the shape of ids "
                             f"{tuple(ids.shape)}.")
        m = attention_mask.long()
        if bool((m[:, 1:] < m[:, :-1]).any()) or bool((m[:, -1] == 0).any()):
            raise ValueError("attention_mask must be left padding (0s then 1s, the last column all 1); "
                             "pad prompts on the left for generation.")


def generate_tokens(
    model: torch.nn.Module,
    ids: Tensor,
    max_new_tokens: int,
    *,
    attention_mask: Tensor | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop_tokens: Iterable[int] | None = None,
    pad_id: int | None = None,
    use_cache: bool = True,
    prefill_chunk: int | None = None,
    overflow: str = "window",
) -> Iterator[Tensor]:
    """Yield the ``(B,)`` new tokens of each step, as they are produced (see :func:`generate`).

    A sequence that emitted a stop token gets ``pad_id`` afterwards; the iterator ends when every
    sequence has stopped or after ``max_new_tokens`` steps. A caller may stop early: ``close()``
    (or dropping the iterator) releases the KV cache. Arguments are checked at the first step.
    """
    check_sampling(temperature, top_k, top_p)
    _check_ids(model, ids, attention_mask, max_new_tokens)
    if prefill_chunk is not None and prefill_chunk < 1:
        raise ValueError(f"prefill_chunk={prefill_chunk} must be >= 1 (or None for one pass).")
    if overflow not in ("window", "shift"):
        raise ValueError(f"overflow={overflow!r} is not known; choose 'window' or 'shift'.")
    if max_new_tokens == 0:
        return
    B = ids.shape[0]
    stops = torch.tensor(sorted(set(stop_tokens or ())), dtype=torch.long, device=ids.device)
    pad = pad_id if pad_id is not None else (int(stops[0]) if stops.numel() else 0)
    generators = None
    if seed is not None:  # one generator per row: a batched result equals each prompt alone
        generators = [torch.Generator(device=ids.device).manual_seed(seed) for _ in range(B)]
    was_training = model.training
    stepper = None
    try:
        model.eval()
        stepper = _Stepper(model, ids, attention_mask, max_new_tokens, use_cache, prefill_chunk, overflow)
        logits = stepper.first()
        finished = torch.zeros(B, dtype=torch.bool, device=ids.device)
        for step in range(max_new_tokens):
            with torch.inference_mode():
                tok = sample(logits, temperature, top_k, top_p, generators)     # (B,)
                if stops.numel():
                    tok = tok.masked_fill(finished, pad)
                    finished = finished | torch.isin(tok, stops)
            yield tok.clone()
            if step + 1 == max_new_tokens or bool(finished.all()):
                return
            logits = stepper.next(tok)
    finally:
        if stepper is not None:
            stepper.close()
        else:  # setup failed part-way: drop any cache it attached
            clear_kv_cache(model)
        model.train(was_training)


def generate(
    model: torch.nn.Module,
    ids: Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int | None = None,
    top_p: float | None = None,
    attention_mask: Tensor | None = None,
    stop_tokens: Iterable[int] | None = None,
    pad_id: int | None = None,
    use_cache: bool = True,
    prefill_chunk: int | None = None,
    overflow: str = "window",
) -> Tensor:
    """Continue ``ids (B, T)`` by up to ``max_new_tokens`` tokens.

    Args:
        model: a :class:`~tformer.models.decoder.DecoderLM`.
        ids: ``(B, T)`` prompt ids, left-padded when ``attention_mask`` is given.
        max_new_tokens: the most tokens to add.
        temperature: 0 is greedy; higher is more random.
        top_k: sample only among the k most likely tokens.
        seed: makes sampling reproducible (each row gets its own generator seeded with it).
        top_p: nucleus sampling: the smallest set of tokens whose probability reaches ``top_p``.
        attention_mask: ``(B, T)`` 1 for tokens, 0 for left padding.
        stop_tokens: ids that end a sequence (the stop token is kept; ``pad_id`` follows it).
        pad_id: fills a stopped sequence; default the first stop token.
        use_cache: KV cache (default) or full recomputation every step.
        prefill_chunk: run the prompt through the model this many tokens at a time.
        overflow: past ``context_length``, ``"window"`` recomputes the last ``context_length``
            tokens every step (nanoGPT); ``"shift"`` keeps the last half, re-prefills it once and
            continues with the cache (much faster; the model sees half to all of the context).
    Returns:
        ``(B, T + n)`` ids, ``n <= max_new_tokens`` (fewer only when every row hit a stop token).
    Raises:
        ValueError: bad sampling options, an empty prompt, a prompt longer than the context, a
            mask that is not left padding.
    """
    steps = list(generate_tokens(
        model, ids, max_new_tokens, attention_mask=attention_mask, temperature=temperature,
        top_k=top_k, top_p=top_p, seed=seed, stop_tokens=stop_tokens, pad_id=pad_id,
        use_cache=use_cache, prefill_chunk=prefill_chunk, overflow=overflow))
    if not steps:
        return ids.clone()
    return torch.cat([ids, torch.stack(steps, dim=1)], dim=1)
