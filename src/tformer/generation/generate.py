"""Autoregressive generation: predict the next token, append it, repeat.

With the KV cache (the default) the prompt is run once (the *prefill*, optionally in chunks) and
each later step feeds only the newest token, at its absolute position, attending over the cached
keys and values: O(n) work per token instead of O(n²). ``use_cache=False`` recomputes the whole
window every step (nanoGPT's way); both give the same logits (the tests hold them equal).

The cache lives in a per-request :class:`~tformer.models.state.InferenceState` that this module
makes with ``model.new_state`` and owns; the model holds none of it and is never switched between
train and eval (the forward runs under ``torch.inference_mode``, which turns dropout off), so any
number of generations may run on one model object, interleaved or from several threads.

Prompts of different lengths are batched with *left* padding and a ``(B, T)`` attention mask of
1 (token) / 0 (padding): every sequence then ends at the same index, so one new column is written
per step. Each sequence gets its own positions (``cumsum(mask) - 1``) and its own random
generator, so a batched result equals generating each prompt alone.

Every model call is :func:`tformer.generation.step.prefill` or :func:`~tformer.generation.step.decode_step`,
the pair the server and beam search use too. Decode steps can run *static*
(``GenerationOptions(static=True)``, or ``compile=True`` which implies it): the state is made with
``model.new_state(..., static=True)``, whose per-row write indices, positions and buffers are
tensors whose shapes never change, so ``torch.compile`` captures the whole step once (gpt-fast's
recipe). Token choice is :mod:`tformer.generation.sampling`.

Entry points: :func:`generate` (token ids in, token ids out) and :func:`generate_tokens` (an
iterator over the new tokens); options in one :class:`GenerationOptions`. The text API (strings in
and out, stop strings, streaming) is in ``tformer.generation.text``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Iterator

import torch

from tformer.errors import InputError, TformerError
from tformer.generation.penalties import History, Penalties, penalize
from tformer.generation.sampling import check_max_new_tokens, check_sampling, sample
from tformer.generation.step import decode_step, prefill
from tformer.nn.embedding import check_ids

Tensor = torch.Tensor


@dataclass(frozen=True)
class GenerationOptions:
    """Everything that decides how tokens are chosen and computed, checked once.

    Attributes:
        temperature: 0 is greedy; higher is more random.
        top_k: sample only among the k most likely tokens.
        top_p: nucleus sampling: the smallest set of tokens whose probability reaches ``top_p``.
        min_p: keep only tokens at least ``min_p`` times as likely as the most likely one.
        repetition_penalty, presence_penalty, frequency_penalty, logit_bias: see
            :mod:`tformer.generation.penalties` (``logit_bias``: ``{token id: added logit}``).
        seed: makes sampling reproducible (each row gets its own generator seeded with it).
        stop_tokens: ids that end a sequence (the stop token is kept; ``pad_id`` follows it).
        pad_id: fills a stopped sequence; default the first stop token.
        use_cache: KV cache (default) or full recomputation every step.
        prefill_chunk: run the prompt through the model this many tokens at a time.
        overflow: past ``context_length``, ``"window"`` recomputes the last ``context_length``
            tokens every step (nanoGPT); ``"shift"`` keeps the last half, re-prefills it once and
            continues with the cache (much faster; the model sees half to all of the context).
        static: decode steps through the static-shape path (tensor positions and write slots).
        compile: ``torch.compile`` the static decode step (implies ``static``).
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    stop_tokens: tuple[int, ...] = ()
    pad_id: int | None = None
    use_cache: bool = True
    prefill_chunk: int | None = None
    overflow: str = "window"
    static: bool = False
    compile: bool = False

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_k, self.top_p, self.seed, min_p=self.min_p)
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else (self.logit_bias or ())
        object.__setattr__(self, "logit_bias", tuple((int(t), float(v)) for t, v in bias))
        self.penalties.check()
        object.__setattr__(self, "stop_tokens", tuple(sorted(set(int(t) for t in (self.stop_tokens or ())))))
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise InputError(f"prefill_chunk={self.prefill_chunk} must be >= 1 (or None for one pass).")
        if self.overflow not in ("window", "shift"):
            raise InputError(f"overflow={self.overflow!r} is not known; choose 'window' or 'shift'.")

    @classmethod
    def of(cls, options: "GenerationOptions | None" = None, **overrides) -> "GenerationOptions":
        """``options`` with ``overrides`` applied (unknown names refused with the list of known ones)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise InputError(f"unknown generation option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}.")
        overrides = {k: (() if k == "stop_tokens" and v is None else v) for k, v in overrides.items()}
        return dataclasses.replace(options or cls(), **overrides)

    @property
    def penalties(self) -> Penalties:
        return Penalties(self.repetition_penalty, self.presence_penalty, self.frequency_penalty, self.logit_bias)

    @property
    def is_static(self) -> bool:
        return self.static or self.compile


# ---------------------------------------------------------------------------------- the stepper
class _Stepper:
    """Runs the model for generation: ``first()`` prefills, ``next(tokens)`` appends and steps
    (through :func:`~tformer.generation.step.prefill` and :func:`~tformer.generation.step.decode_step`).

    Both return ``(B, vocab)`` logits for the next token. Owns the request's inference state, the
    output buffer ``out (B, capacity)`` (grown by doubling, so a huge ``max_new_tokens`` costs
    nothing up front) and the per-sequence padding mask.

    Past the context, ``overflow`` decides what the model sees: ``"window"`` recomputes the last
    ``context_length`` tokens every step (nanoGPT's semantics, O(context) tokens per step);
    ``"shift"`` keeps the last ``context_length // 2`` tokens, prefills them once and goes on with
    the cache (amortised O(1) forward tokens per step; the model sees between half and all of
    the context). With ``use_cache=False`` the same windows are recomputed from scratch.
    """

    def __init__(self, model, ids: Tensor, attention_mask: Tensor | None, max_new_tokens: int,
                 opts: GenerationOptions):
        B, T = ids.shape
        self.model, self.T, self.opts = model, T, opts
        self.context = model.config.context_length
        total = T + max_new_tokens
        self.out = torch.empty(B, min(total, max(2 * T, T + 256)), dtype=torch.long, device=ids.device)
        self.out[:, :T] = ids
        self.cur = T                                       # tokens written to ``out`` so far
        self.offset = 0                                    # ``out`` index of the window's first token
        self.mask = None                                   # (B, capacity) 1/0, only when there is padding
        if attention_mask is not None and not bool(attention_mask.all()):
            self.mask = torch.ones_like(self.out)
            self.mask[:, :T] = attention_mask
        self.chunk = opts.prefill_chunk if opts.prefill_chunk and opts.prefill_chunk < T else None
        # A compiled step sees the same shapes in every call only if the state always spans the context.
        cache_len = (self.context if opts.compile else min(total, self.context)) if opts.use_cache else 0
        self.state = model.new_state(B, cache_len, static=opts.is_static) if cache_len else None
        # The static step's input: one buffer, so its shape and strides never change between steps.
        self.step_tokens = torch.empty(B, 1, dtype=torch.long, device=ids.device) if opts.is_static else None

    def _grow(self) -> None:
        if self.cur < self.out.shape[1]:
            return
        bigger = torch.empty(self.out.shape[0], 2 * self.out.shape[1], dtype=torch.long, device=self.out.device)
        bigger[:, :self.cur] = self.out
        self.out = bigger
        if self.mask is not None:
            mask = torch.ones_like(bigger)
            mask[:, :self.cur] = self.mask[:, :self.cur]
            self.mask = mask

    def _prefill(self, start: int, end: int, state, chunk: int | None = None) -> Tensor:
        """Logits of the token after ``out[:, start:end]``, after what ``state`` holds."""
        # Positions count from 0 at the window's first token: the model derives them from the mask of
        # the new tokens and the real tokens ``state.valid`` holds (left padding shifts nothing), or,
        # without padding, from the state's length.
        mask = self.mask[:, start:end] if self.mask is not None else None
        return prefill(self.model, self.out[:, start:end], state, attention_mask=mask, chunk=chunk)

    @torch.inference_mode()
    def first(self) -> Tensor:
        return self._prefill(0, self.T, self.state, self.chunk if self.state is not None else None)

    @torch.inference_mode()
    def next(self, tokens: Tensor) -> Tensor:
        self._grow()
        pos = self.cur
        self.out[:, pos] = tokens
        self.cur += 1
        if self.cur - self.offset > self.context:    # the window is full
            if self.opts.overflow == "shift":
                self.offset = self.cur - max(1, self.context // 2)
                if self.state is None:
                    return self._prefill(self.offset, self.cur, None)
                self.state.reset()                   # positions restart from the kept window
                return self._prefill(self.offset, self.cur, self.state)      # re-prefill the kept half
            self.offset = self.cur - self.context
        if self.state is not None and (self.opts.overflow == "shift" or self.offset == 0):
            return self._decode(pos)                                         # feed one token to the cache
        return self._prefill(self.offset, self.cur, None)                    # recompute the window

    def _decode(self, pos: int) -> Tensor:
        if self.step_tokens is None:
            mask = self.mask[:, pos:pos + 1] if self.mask is not None else None
            return decode_step(self.model, self.out[:, pos:pos + 1], self.state, attention_mask=mask)
        self.step_tokens.copy_(self.out[:, pos:pos + 1])                    # generated tokens are real
        return decode_step(self.model, self.step_tokens, self.state, compiled=self.opts.compile)


# ------------------------------------------------------------------------------------- ids API
def _check_ids(model, ids: Tensor, attention_mask: Tensor | None, max_new_tokens: int) -> None:
    if not getattr(model.config, "causal", False) or not hasattr(model, "lm_head") or not hasattr(model, "new_state"):
        raise InputError(f"generation needs a causal language model (DecoderLM); this is a "
                         f"{type(model).__name__}. For an encoder use `tformer embed` or EncoderModel.encode.")
    if ids.dim() != 2:
        raise InputError(f"ids must be (batch, seq_len), got shape {tuple(ids.shape)}.")
    if ids.shape[1] == 0 or ids.shape[0] == 0:
        raise InputError("the prompt is empty; give at least one token (e.g. a start/newline token).")
    context = model.config.context_length
    if ids.shape[1] > context:
        raise InputError(
            f"the prompt has {ids.shape[1]} tokens but the model's context is {context} "
            f"(config.context_length); shorten the prompt or use a model with a larger context_length.")
    check_max_new_tokens(max_new_tokens)
    check_ids(ids, model.config.vocab_size)
    if attention_mask is not None:
        if attention_mask.shape != ids.shape:
            raise InputError(f"attention_mask {tuple(attention_mask.shape)} must have the shape of ids "
                             f"{tuple(ids.shape)}.")
        m = attention_mask.long()
        if bool((m[:, 1:] < m[:, :-1]).any()) or bool((m[:, -1] == 0).any()):
            raise InputError("attention_mask must be left padding (0s then 1s, the last column all 1); "
                             "pad prompts on the left for generation.")


def generate_tokens(
    model: torch.nn.Module,
    ids: Tensor,
    max_new_tokens: int,
    options: GenerationOptions | None = None,
    *,
    attention_mask: Tensor | None = None,
    **overrides,
) -> Iterator[Tensor]:
    """Yield the ``(B,)`` new tokens of each step, as they are produced (see :func:`generate`).

    A sequence that emitted a stop token gets ``pad_id`` afterwards; the iterator ends when every
    sequence has stopped or after ``max_new_tokens`` steps. A caller may stop early: dropping the
    iterator drops its state. Arguments are checked at the first step.
    """
    opts = GenerationOptions.of(options, **overrides)
    _check_ids(model, ids, attention_mask, max_new_tokens)
    if max_new_tokens == 0:
        return
    B = ids.shape[0]
    stops = torch.tensor(opts.stop_tokens, dtype=torch.long, device=ids.device)
    pad = opts.pad_id if opts.pad_id is not None else (opts.stop_tokens[0] if opts.stop_tokens else 0)
    generators = None
    if opts.seed is not None:  # one generator per row: a batched result equals each prompt alone
        generators = [torch.Generator(device=ids.device).manual_seed(opts.seed) for _ in range(B)]
    penalties = opts.penalties
    if penalties.active:
        penalties.check(model.config.vocab_size)
    history = History(ids, model.config.vocab_size, attention_mask, penalties) if penalties.active else None
    stepper = _Stepper(model, ids, attention_mask, max_new_tokens, opts)
    logits = stepper.first()
    finished = torch.zeros(B, dtype=torch.bool, device=ids.device)
    for step in range(max_new_tokens):
        with torch.inference_mode():
            if not _finite(logits):
                raise TformerError(f"the model produced non-finite logits (NaN or inf) at generation step {step}; "
                                   f"its weights are damaged or overflow in {logits.dtype}: use another checkpoint "
                                   f"or a wider dtype (fp32).")
            if history is not None:
                logits = penalize(logits, history)
            tok = sample(logits, opts.temperature, opts.top_k, opts.top_p, generators, opts.min_p)     # (B,)
            if history is not None:
                history.add(tok)
            if stops.numel():
                tok = tok.masked_fill(finished, pad)
                finished = finished | torch.isin(tok, stops)
        yield tok                                             # a fresh tensor every step
        if step + 1 == max_new_tokens or (stops.numel() and bool(finished.all())):
            return
        logits = stepper.next(tok)


def _finite(logits: Tensor) -> bool:
    """Whether every logit is finite: a NaN or an inf anywhere makes the sum NaN or inf, so a finite sum
    answers in one vectorised reduction, about ten times cheaper than ``isfinite(logits).all()`` over a
    vocabulary's logits, which was the largest small op of a decode step
    (docs/inference.md#speed-against-llamacpp-and-hf-in-the-same-run); a sum that overflowed from finite
    logits falls back to the element-wise test."""
    return math.isfinite(float(logits.sum())) or bool(torch.isfinite(logits).all())


def generate(
    model: torch.nn.Module,
    ids: Tensor,
    max_new_tokens: int,
    options: GenerationOptions | None = None,
    *,
    attention_mask: Tensor | None = None,
    **overrides,
) -> Tensor:
    """Continue ``ids (B, T)`` by up to ``max_new_tokens`` tokens.

    Args:
        model: a :class:`~tformer.models.decoder.DecoderLM`.
        ids: ``(B, T)`` prompt ids, left-padded when ``attention_mask`` is given.
        max_new_tokens: the most tokens to add.
        options: a :class:`GenerationOptions`; keyword ``overrides`` replace its fields
            (``generate(model, ids, 20, temperature=0)``).
        attention_mask: ``(B, T)`` 1 for tokens, 0 for left padding.
    Returns:
        ``(B, T + n)`` ids, ``n <= max_new_tokens`` (fewer only when every row hit a stop token).
    Raises:
        InputError: bad options, an empty prompt, a prompt longer than the context, ids outside
            the vocabulary, a mask that is not left padding.
    """
    steps = list(generate_tokens(model, ids, max_new_tokens, options, attention_mask=attention_mask, **overrides))
    if not steps:
        return ids.clone()
    return torch.cat([ids, torch.stack(steps, dim=1)], dim=1)
