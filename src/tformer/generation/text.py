"""Generation with text in and text out: tokenise prompts, batch them with left padding, decode
the new tokens as they come, and cut at stop strings.

Entry points:
    :func:`generate_text`  text in, text out; stop strings; one prompt or a list.
    :func:`stream_text`    an iterator over the text of one prompt, as it is produced.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Sequence

import torch

from tformer.errors import InputError
from tformer.generation.generate import generate_tokens

Tensor = torch.Tensor


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[Tensor, Tensor]:
    """Stack token lists of different lengths: ``(ids (B, T), attention_mask (B, T))``, padded left."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise InputError("every prompt needs at least one token; got an empty prompt.")
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, T - len(p):] = torch.tensor(list(p), dtype=torch.long)
        mask[i, T - len(p):] = 1
    return ids, mask


class TextTracker:
    """Decodes one sequence's new tokens and applies stop strings exactly (``generate_text``,
    ``stream_text`` and the server's scheduler each keep one per sequence).

    Args:
        tokenizer: with ``decode(list[int]) -> str``.
        stop: strings that end the text; it is cut just before the first one.

    ``add(token)`` appends a token; ``done`` turns true at a stop string (a caller may set it to
    release what is held back at the end); ``text`` is the text so far.

    ``safe()`` is the text that can be shown now: cut at the first stop string, and holding back
    an undecodable tail (partial UTF-8) and any tail that could still become a stop string.
    """

    def __init__(self, tokenizer, stop: Sequence[str]):
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        self.ids: list[int] = []
        self.text, self.done, self.sent = "", False, 0

    def add(self, token: int) -> None:
        self.ids.append(token)
        self.text = self.tokenizer.decode(self.ids)
        cut = min((i for i in (self.text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.done = self.text[:cut], True

    def safe(self) -> str:
        if self.done:
            return self.text
        end = len(self.text.rstrip("\ufffd"))
        hold = 0
        for s in self.stop:                     # longest tail that is a prefix of a stop string
            for k in range(min(len(s) - 1, end), hold, -1):
                if self.text[end - k:end] == s[:k]:
                    hold = k
                    break
        end -= hold
        return self.text[:end]

    def take(self) -> str:
        """The new showable text since the last call (all of it once ``done``)."""
        new = self.safe()[self.sent:]
        self.sent += len(new)
        return new


def _text_steps(model, tokenizer, prompts: list[str], max_new_tokens: int, stop: Sequence[str],
                stop_tokens: Iterable[int] | None, kwargs: dict) -> Iterator[list[TextTracker]]:
    stats = kwargs.pop("stats", None)
    encoded = [tokenizer.encode(p) for p in prompts]
    if any(len(e) == 0 for e in encoded):
        raise InputError("the prompt is empty; give at least one character of text.")
    ids, mask = left_pad(encoded)
    device = next(model.parameters()).device
    ids, mask = ids.to(device), mask.to(device)
    stop_set = set(stop_tokens or ())
    trackers = [TextTracker(tokenizer, stop) for _ in prompts]
    steps = generate_tokens(model, ids, max_new_tokens, attention_mask=mask if len(prompts) > 1 else None,
                            stop_tokens=stop_set or None, **kwargs)
    try:
        for step, tok in enumerate(steps):
            if stats is not None:
                stats["new_tokens"] = (step + 1) * len(prompts)
            for tracker, t in zip(trackers, tok.tolist()):
                if tracker.done:
                    continue
                if t in stop_set:
                    tracker.done = True
                else:
                    tracker.add(t)
            yield trackers
            if all(t.done for t in trackers):
                return
    finally:
        steps.close()


def generate_text(model, tokenizer, prompt: str | Sequence[str], max_new_tokens: int = 100, *,
                  stop: Sequence[str] = (), stop_tokens: Iterable[int] | None = None, **kwargs) -> str | list[str]:
    """Complete one prompt (returns a string) or a batch of prompts (returns a list of strings).

    Args:
        tokenizer: with ``encode(str) -> list[int]`` and ``decode(list[int]) -> str``.
        stop: strings that end a completion; the completion is cut just before the first one.
        stop_tokens: token ids that end a completion (not included in the text).
        **kwargs: sampling and cache options of :func:`generate`; ``stats={}`` receives
            ``new_tokens``, the tokens the model produced (all rows, including stopped ones).
    Returns:
        the completion text(s), without the prompt.
    """
    single = isinstance(prompt, str)
    prompts = [prompt] if single else list(prompt)
    if not prompts:
        raise InputError("no prompts given.")
    trackers = [TextTracker(tokenizer, stop) for _ in prompts]
    for trackers in _text_steps(model, tokenizer, prompts, max_new_tokens, stop, stop_tokens, kwargs):
        pass
    texts = [t.text for t in trackers]
    return texts[0] if single else texts


def stream_text(model, tokenizer, prompt: str, max_new_tokens: int = 100, *, stop: Sequence[str] = (),
                stop_tokens: Iterable[int] | None = None, **kwargs) -> Iterator[str]:
    """Yield the completion of one prompt piece by piece; ``"".join`` of it equals
    :func:`generate_text` with the same arguments."""
    if not isinstance(prompt, str):
        raise InputError("stream_text takes one prompt (a str); use generate_text for a batch.")
    tracker = None
    for (tracker,) in _text_steps(model, tokenizer, [prompt], max_new_tokens, stop, stop_tokens, kwargs):
        piece = tracker.take()
        if piece:
            yield piece
    if tracker is not None:
        tracker.done = True                    # the end: release anything held back
        piece = tracker.take()
        if piece:
            yield piece
