"""Structured output: a per-sequence constraint that lets through only the tokens a grammar allows.

``response_format: {"type": "json_schema", ...}`` and ``{"type": "json_object"}`` become a
:class:`JSONConstraint` on the request's :class:`~tformer.serve.scheduler.Sequence`. The scheduler
calls ``mask(row)`` on the sequence's logits row right before it picks a token and ``advance(token)``
right after, so whatever the sampling options, the picked token is one the grammar accepts next:

    logits'[v] = logits[v]   if v extends the text to a prefix of some string in the language
               = -inf        otherwise                                              (row: (vocab,))

Once the JSON value is complete, only the end-of-turn tokens are allowed, so the sequence finishes
with ``finish_reason: "stop"``. Greedy decoding under the mask is "argmax over the allowed tokens";
sampling draws from the model's distribution renormalised over them.

The engine is llguidance (PyPI ``llguidance``, the ``grammar`` extra; a Rust library whose token mask walks a
trie of the vocabulary against the grammar's lexer and Earley parser). The vocabulary is compiled once per
server (:class:`GrammarEngine`, under a second), a schema once per request (about a millisecond, off the event
loop; the request's ``n`` sequences each get a copy of that one compiled matcher).
``benchmarks/serving/grammar_overhead.py`` measured it against xgrammar on SmolLM2's 49,152-token vocabulary
(figures: benchmarks/results/serving/grammar_overhead.md): xgrammar is faster per token, which the criterion
fixed before the run would have picked, but the same run found that xgrammar 0.2.9 lets raw control characters
(U+0000-U+001F) into JSON strings, which RFC 8259 forbids and ``json.loads`` refuses; invalid JSON
disqualifies it whatever its speed, so llguidance it is.
"""

from __future__ import annotations

import json

import numpy as np
import torch

from tformer.errors import ConfigError, InputError

Tensor = torch.Tensor
MISSING = "structured output (response_format) needs the grammar engine llguidance: pip install 'tformer[grammar]'."
# The JSON the grammar writes: compact separators and no free whitespace, so a small model cannot
# spend its tokens on blank lines, and every value ends.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def unpack(words: Tensor, vocab_size: int) -> Tensor:
    """``(vocab,)`` bool from the engine's bitmask ``words (W,) int32``: token ``v`` is bit ``v % 32``
    (least significant first) of word ``v // 32``; on a little-endian machine that is bit ``v % 8`` of
    byte ``v // 8`` of the words stored little-endian, which numpy unpacks in one call (torch has no
    bit unpacking)."""
    little = words.numpy().astype("<i4", copy=False)                  # a no-op on x86 and ARM
    bits = np.unpackbits(little.view(np.uint8), bitorder="little")[:vocab_size]      # (vocab,) 0/1
    return torch.from_numpy(bits.view(np.bool_))


def available() -> bool:
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return False
    return True


class GrammarEngine:
    """One tokenizer's vocabulary, compiled for the grammar engine (made once per server).

    Args:
        tokenizer: a tformer tokenizer backed by HF ``tokenizers`` (its ``.tok``); a character
            vocabulary has none, and is refused.
        vocab_size: the model's logits width (>= the tokenizer's; ids past it are never allowed).
        stop_ids: the end-of-turn ids; the grammar allows them once the value is complete.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_ids):
        try:
            import llguidance
        except ImportError:
            raise ConfigError(MISSING) from None
        backend = getattr(tokenizer, "tok", None)
        if backend is None or not hasattr(backend, "to_str"):
            raise InputError(f"structured output needs a byte-level (HF tokenizers) vocabulary, and this model's "
                             f"tokenizer is a {type(tokenizer).__name__}; serve a model with a tokenizer.json.")
        if not stop_ids:
            raise InputError("structured output needs an end-of-turn token to end the value with, and this model "
                             "has none; save eos_token_id with the checkpoint.")
        self.llg = llguidance
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=sorted(stop_ids))
        self.stop_mask = torch.zeros(vocab_size, dtype=torch.bool)                    # (vocab,) end-of-turn ids
        self.stop_mask[[i for i in stop_ids if 0 <= i < vocab_size]] = True

    def json(self, schema: dict | None) -> "JSONConstraint":
        """A fresh constraint for one sequence: any JSON object when ``schema`` is None (json_object),
        else a value valid against ``schema``; an :class:`InputError` naming the problem when the
        engine cannot compile the schema."""
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            json.dumps({"type": "object"} if schema is None else schema), defaults=JSON_OPTIONS)
        matcher = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InputError(f"response_format: the JSON schema cannot be used ({matcher.get_error()}); "
                             f"simplify it or send a valid JSON Schema.")
        constraint = JSONConstraint(matcher, self.vocab_size)
        if not (constraint.allowed() & ~self.stop_mask).any():
            # The grammar admits no JSON text at all (e.g. a $ref that only refers to itself): the only
            # token it allows is end-of-turn, which would answer 200 with empty content.
            raise InputError("response_format: the JSON schema admits no JSON value (a $ref that only leads back to "
                             "itself, or constraints nothing satisfies); send a schema some value is valid against.")
        return constraint


class JSONConstraint:
    """The grammar state of one sequence: :meth:`mask` before each choice, :meth:`advance` after."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size
        self.words = torch.full(((vocab_size + 31) // 32,), -1, dtype=torch.int32)    # (W,) 32 tokens per word

    def copy(self) -> "JSONConstraint":
        """An independent constraint in the same state (the compiled grammar is shared, not compiled again)."""
        return JSONConstraint(self.matcher.deep_copy(), self.vocab_size)

    def allowed(self) -> Tensor:
        """``(vocab,)`` bool: the tokens the grammar accepts next."""
        if self.matcher.is_error():
            raise InputError(f"the grammar failed while generating ({self.matcher.get_error()})")
        self.matcher.unsafe_compute_mask_ptr(self.words.data_ptr(), self.words.numel() * 4)
        return unpack(self.words, self.vocab_size)

    def mask(self, row: Tensor) -> None:
        """Set ``row (vocab,)`` to -inf, in place, at every token the grammar does not allow next."""
        row.masked_fill_(~self.allowed()[:row.shape[-1]], float("-inf"))

    def advance(self, token: int) -> None:
        """Feed the picked token to the grammar (one :meth:`mask` allowed it, so it is accepted)."""
        if not self.matcher.consume_token(token):
            raise InputError(f"the grammar refused token {token} ({self.matcher.get_error()})")

    @property
    def complete(self) -> bool:
        """Whether the text so far is a whole value (only end-of-turn tokens are allowed now)."""
        return self.matcher.is_stopped() or self.matcher.is_accepting()
