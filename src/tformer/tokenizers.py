"""Tokenizers: text <-> token ids. Each one saves itself as ``tokenizer.json`` beside a checkpoint.

Interface shared by every tokenizer: ``encode(str) -> list[int]``, ``decode(list[int]) -> str``,
``vocab_size``, ``save(path)``, ``to_dict()``; :func:`load_tokenizer` reads any of them back.

Invalid UTF-8: corpus files are decoded with ``errors="replace"`` (each bad byte becomes U+FFFD,
see :mod:`tformer.training.data`), and :func:`clean_text` does the same for strings that carry
undecodable bytes as lone surrogates (Python's ``surrogateescape``, e.g. command-line arguments).
So no input byte can crash a run; ``decode(encode(text)) == text`` for every clean string.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable

import numpy as np

from tformer.checkpoint import resolve_checkpoint
from tformer.io import atomic_write_json
from tformer.errors import CheckpointError, ConfigError, InputError

TOKENIZER = "tokenizer.json"
KINDS = ("char", "bpe")


def clean_text(text: str) -> str:
    """Replace lone surrogates (undecodable bytes smuggled into a ``str``) by U+FFFD; else unchanged."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        try:
            raw = text.encode("utf-8", "surrogateescape")   # back to the original bytes
        except UnicodeEncodeError:
            raw = text.encode("utf-8", "surrogatepass")
        return raw.decode("utf-8", "replace")


class CharTokenizer:
    """One id per distinct character of the training text (nanoGPT's shakespeare_char)."""

    kind = "char"

    def __init__(self, chars: list[str]):
        self.chars = list(chars)
        self.index = {c: i for i, c in enumerate(self.chars)}
        # Sorted code points -> ids, for vectorised encoding of long texts.
        order = sorted(range(len(self.chars)), key=lambda i: ord(self.chars[i]))
        self._points = np.array([ord(self.chars[i]) for i in order], dtype=np.int64)
        self._ids = np.array(order, dtype=np.int64)

    @classmethod
    def train(cls, text: str | Iterable[str]) -> "CharTokenizer":
        """Vocabulary = the sorted distinct characters of ``text`` (a string or an iterable of chunks)."""
        chunks = [text] if isinstance(text, str) else text
        chars: set[str] = set()
        for chunk in chunks:
            chars.update(clean_text(chunk))
        if not chars:
            raise InputError("cannot build a character vocabulary from empty text; give a non-empty corpus.")
        return cls(sorted(chars))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()

    def encode_array(self, text: str) -> np.ndarray:
        """``encode`` as an int64 array, vectorised (a few MB per second per core is not enough)."""
        text = clean_text(text)
        points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
        pos = np.searchsorted(self._points, points).clip(max=max(len(self._points) - 1, 0))
        bad = self._points[pos] != points if len(points) else np.zeros(0, bool)
        if bad.any():
            unknown = sorted({chr(p) for p in points[bad]})
            raise InputError(f"characters {''.join(unknown[:10])!r} are not in this character vocabulary "
                             f"({self.vocab_size} characters); use only characters seen in training.")
        return self._ids[pos]

    def decode(self, ids: Iterable[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "chars": self.chars}

    def save(self, path: str | os.PathLike) -> None:
        atomic_write_json(path, self.to_dict())


class BPETokenizer:
    """Byte-level BPE (GPT-2 style) trained on the corpus with Hugging Face ``tokenizers``.

    Every byte has a token, so any text encodes; merges learned from the corpus shorten it.
    """

    kind = "bpe"

    def __init__(self, tokenizer):  # a tokenizers.Tokenizer
        self.tok = tokenizer

    @classmethod
    def train(cls, text: str | Iterable[str], vocab_size: int = 1024) -> "BPETokenizer":
        """Learn ``vocab_size - 256`` merges on top of the 256 byte tokens.

        Raises:
            ConfigError: ``vocab_size`` below 256 (each byte needs a token).
        """
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        if vocab_size < 256:
            raise ConfigError(f"bpe_vocab_size={vocab_size} is too small: byte-level BPE needs at least 256 "
                             f"(one token per byte); use e.g. --set bpe_vocab_size=1024.")
        chunks = [text] if isinstance(text, str) else text
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, special_tokens=[],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator((clean_text(c) for c in chunks), trainer)
        return cls(tok)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(clean_text(text)).ids

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.int64)

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode([int(i) for i in ids])

    def to_dict(self) -> dict:
        return {"kind": self.kind, "tokenizer": json.loads(self.tok.to_str())}

    def save(self, path: str | os.PathLike) -> None:
        atomic_write_json(path, self.to_dict())


class HFTokenizer(BPETokenizer):
    """Any HuggingFace ``tokenizers`` file (BPE, WordPiece, Unigram), used as it is: the
    ``tokenizer.json`` of a converted HF model."""

    kind = "tokenizers"


def train_tokenizer(kind: str, chunks: Iterable[str], vocab_size: int = 1024):
    """Train a tokenizer of ``kind`` (``char`` or ``bpe``) on an iterable of text chunks."""
    if kind == "char":
        return CharTokenizer.train(chunks)
    if kind == "bpe":
        return BPETokenizer.train(chunks, vocab_size)
    raise ConfigError(f"tokenizer={kind!r} is not known; choose one of {', '.join(KINDS)}.")


def tokenizer_from_dict(data: dict):
    """Rebuild a tokenizer from :meth:`to_dict` output, or from a HuggingFace ``tokenizer.json``
    (the ``tokenizers`` library's own file, as ``tformer convert --from-hf`` copies it along)."""
    kind = data.get("kind")
    if kind is None and "model" in data:  # the tokenizers library's own file
        data = {"kind": HFTokenizer.kind, "tokenizer": data}
        kind = HFTokenizer.kind
    if kind == HFTokenizer.kind:
        from tokenizers import Tokenizer
        return HFTokenizer(Tokenizer.from_str(json.dumps(data["tokenizer"])))
    if kind == "char":
        return CharTokenizer(data["chars"])
    if kind == "bpe":
        from tokenizers import Tokenizer
        return BPETokenizer(Tokenizer.from_str(json.dumps(data["tokenizer"])))
    raise CheckpointError(f"unknown tokenizer kind {kind!r}; known: {', '.join(KINDS)}.")


def load_tokenizer(path: str | os.PathLike):
    """Read a tokenizer from ``tokenizer.json`` or from a checkpoint folder that holds one."""
    path = Path(path)
    if path.is_dir():  # a checkpoint folder, or a run folder (its latest checkpoint)
        path = path / TOKENIZER if (path / TOKENIZER).is_file() else resolve_checkpoint(path) / TOKENIZER
    if not path.is_file():
        raise CheckpointError(f"no tokenizer at {path}; pass a checkpoint folder written by `tformer train`.")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return tokenizer_from_dict(data)
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from e
    except Exception as e:  # json / tokenizers errors
        raise CheckpointError(f"cannot read {path}: {e}. The checkpoint is damaged; retrain or restore it.") from e
