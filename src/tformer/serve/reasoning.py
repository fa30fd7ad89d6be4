"""The thinking of a model whose template lets it think (Qwen3, DeepSeek-R1): ``<think>...</think>`` split
from the answer, as ``reasoning_content`` beside ``content`` (vLLM's and llama.cpp's field).

An answer that begins with ``<think>`` (leading whitespace aside), or follows a prompt that ends with it (a
template that makes the model think: :func:`opens_thinking`), is reasoning up to ``</think>``, the answer
after it. One that never opens the tag, or opens it later, is all content. A stream is split as it comes
(:class:`Splitter`): text that could still be the start of a tag is held back until it is not.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def split(text: str, thinking: bool = False) -> tuple[str | None, str]:
    """``(reasoning, content)`` of a whole answer; reasoning None when the answer does not think.
    ``thinking``: the prompt already opened ``<think>`` (a template that makes the model think)."""
    s = Splitter(thinking)
    parts = s.feed(text) + s.flush()
    reasoning = "".join(t for f, t in parts if f == "reasoning_content")
    return (reasoning if s.thought else None), "".join(t for f, t in parts if f == "content")


class Splitter:
    """Feed an answer's text piece by piece; get ``(field, text)`` pieces, field ``"reasoning_content"`` or
    ``"content"``."""

    def __init__(self, thinking: bool = False):
        self.state, self.held, self.thought = ("thinking", "", True) if thinking else ("start", "", False)

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.held += text
        out = []
        while True:
            if self.state == "start":
                body = self.held.lstrip()
                if body.startswith(OPEN):
                    self.held, self.state, self.thought = body[len(OPEN):], "thinking", True
                    continue
                if OPEN.startswith(body):                             # could still become <think>
                    return out
                self.state = "answer"
            if self.state == "thinking":
                at = self.held.find(CLOSE)
                if at >= 0:
                    if at:
                        out.append(("reasoning_content", self.held[:at]))
                    self.held, self.state = self.held[at + len(CLOSE):], "gap"
                    continue
                keep = next((k for k in range(len(CLOSE) - 1, 0, -1) if self.held.endswith(CLOSE[:k])), 0)
                if len(self.held) > keep:
                    out.append(("reasoning_content", self.held[:len(self.held) - keep]))
                    self.held = self.held[len(self.held) - keep:]
                return out
            if self.state == "gap":                                   # the newlines after </think>
                self.held = self.held.lstrip("\n")
                if not self.held:
                    return out
                self.state = "answer"
            if self.held:
                out.append(("content", self.held))
                self.held = ""
            return out

    def flush(self) -> list[tuple[str, str]]:
        """What is held at the end of the answer."""
        text, self.held = self.held, ""
        if not text:
            return []
        if self.state == "gap":
            text = text.lstrip("\n")
        return [("reasoning_content" if self.state == "thinking" else "content", text)] if text else []


def opens_thinking(tokenizer, prompt: list[int]) -> bool:
    """Whether the rendered prompt ends inside an open ``<think>`` (its last tokens, special ones kept)."""
    try:
        tail = tokenizer.decode(prompt[-8:], skip_special_tokens=False)
    except TypeError:                                   # a character vocabulary: no special tokens to keep
        tail = tokenizer.decode(prompt[-8:])
    return tail.rstrip().endswith(OPEN)
