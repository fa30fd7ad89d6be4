"""Tokenizers: text <-> token ids. Each one saves itself as ``tokenizer.json`` beside a checkpoint.

Interface shared by every tokenizer: ``encode(str) -> list[int]``, ``decode(list[int]) -> str``,
``vocab_size``, ``save(path)``; :func:`load_tokenizer` reads any of them back.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tformer.checkpoint import atomic_write_json

TOKENIZER = "tokenizer.json"


class CharTokenizer:
    """One id per distinct character of the training text (nanoGPT's shakespeare_char)."""

    kind = "char"

    def __init__(self, chars: list[str]):
        self.chars = list(chars)
        self.index = {c: i for i, c in enumerate(self.chars)}

    @classmethod
    def train(cls, text: str) -> "CharTokenizer":
        return cls(sorted(set(text)))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        unknown = sorted({c for c in text if c not in self.index})
        if unknown:
            raise ValueError(f"characters {''.join(unknown[:10])!r} are not in this character vocabulary "
                             f"({self.vocab_size} characters); use only characters seen in training.")
        return [self.index[c] for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    def save(self, path: str | os.PathLike) -> None:
        atomic_write_json(path, {"kind": self.kind, "chars": self.chars})


def load_tokenizer(path: str | os.PathLike):
    """Read a tokenizer from ``tokenizer.json`` or from a checkpoint folder that holds one."""
    path = Path(path)
    if path.is_dir():
        path = path / TOKENIZER
    if not path.is_file():
        raise ValueError(f"no tokenizer at {path}; pass a checkpoint folder written by `tformer train`.")
    data = json.loads(path.read_text(encoding="utf-8"))
    kinds = {"char": lambda d: CharTokenizer(d["chars"])}
    if data.get("kind") not in kinds:
        raise ValueError(f"{path}: unknown tokenizer kind {data.get('kind')!r}; known: {', '.join(kinds)}.")
    return kinds[data["kind"]](data)
