"""Sentence pairs for sequence-to-sequence training: a built-in offline task, TSV files, a shared
word-level tokenizer, padded batches.

The built-in task translates numbers written in English words into the same numbers in French
words (both from the ``num2words`` package): 97 is "ninety-seven" -> "quatre-vingt-dix-sept",
1,200 is "one thousand, two hundred" -> "mille deux cents". Word order mostly carries over, but
French counts in twenties from 60 to 99, agrees "cent"/"cents" and "vingt"/"vingts" with what
follows, drops the "and", and reorders nothing else, so a model must learn local rewriting with
agreement over a few words. Lengths run from 1 to ~35 tokens, so the test split shows how
quality falls with source length. Train and test numbers are disjoint.
"""

from __future__ import annotations

import glob
import json
import os
import random
import re
from pathlib import Path

import torch

from tformer.io import atomic_write
from tformer.errors import InputError
from tformer.training.data import is_binary

PAD, BOS, EOS, UNK = 0, 1, 2, 3
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
_TOKEN = re.compile(r"\w+|[^\w\s]")


def number_pairs(n_train: int, n_test: int, seed: int = 0, max_digits: int = 9) -> tuple[list, list]:
    """``(train, test)`` lists of (English, French) pairs; the number of digits is uniform in
    ``1..max_digits`` so that every length is represented; no number is in both splits."""
    try:
        from num2words import num2words
    except ImportError:
        raise InputError("the built-in task needs num2words; install it with pip install 'tformer[seq2seq]' "
                         "or pass --data pairs.tsv.") from None
    rng = random.Random(seed)
    seen: set[int] = set()
    numbers = []
    limit = 10 ** max_digits                                                # 0 .. 10^max_digits - 1
    if n_train + n_test > limit:
        raise InputError(f"{n_train + n_test} distinct numbers do not exist below 10^{max_digits}; ask for fewer.")
    while len(numbers) < n_train + n_test:
        d = rng.randint(1, max_digits)
        x = rng.randint(0 if d == 1 else 10 ** (d - 1), 10 ** d - 1)
        if x not in seen:
            seen.add(x)
            numbers.append(x)
    pairs = [(num2words(x, lang="en"), num2words(x, lang="fr")) for x in numbers]
    return pairs[:n_train], pairs[n_train:]


def read_pairs(data: str, encoding: str = "utf-8") -> list[tuple[str, str]]:
    """``source<TAB>target`` lines from a file, a folder (its ``*.tsv``/``*.txt``) or a glob, decoded
    with ``encoding``; a binary file (NUL bytes) or one the encoding cannot decode is refused, naming it."""
    p = Path(data)
    files = sorted(p.glob("*.tsv")) + sorted(p.glob("*.txt")) if p.is_dir() else \
        ([p] if p.is_file() else [Path(f) for f in sorted(glob.glob(data))])
    if not files:
        raise InputError(f"--data {data} matches no file; pass a TSV file (source<TAB>target per line), "
                         f"a folder of them or a glob.")
    pairs = []
    for f in files:
        for n, line in enumerate(_read_text(f, encoding).splitlines(), 1):
            if not line.strip():
                continue
            parts = line.split("\t")
            if len(parts) != 2 or not parts[0].strip() or not parts[1].strip():
                raise InputError(f"{f}:{n} is not 'source<TAB>target'; fix that line or remove it.")
            pairs.append((parts[0].strip(), parts[1].strip()))
    if len(pairs) < 2:
        raise InputError(f"--data {data} holds {len(pairs)} pair(s); training needs at least 2 (one held out).")
    return pairs


def _read_text(path: Path, encoding: str) -> str:
    if is_binary(path):
        raise InputError(f"pairs file {path} is binary (it holds NUL bytes), not text; pass a text file of "
                         f"source<TAB>target lines.")
    try:
        return path.read_text(encoding=encoding)
    except UnicodeDecodeError as e:
        raise InputError(f"pairs file {path} is not valid {encoding} (byte {e.object[e.start]:#04x} at offset "
                         f"{e.start}); pass its encoding with --encoding (e.g. --encoding latin-1).") from None
    except LookupError:
        raise InputError(f"--encoding {encoding} is not a text encoding Python knows; use e.g. utf-8 or "
                         f"latin-1.") from None


def split_pairs(pairs: list, test_fraction: float, seed: int = 0) -> tuple[list, list]:
    """Shuffle and hold out ``test_fraction`` (at least one pair) for testing."""
    pairs = list(pairs)
    random.Random(seed).shuffle(pairs)
    n_test = max(1, int(len(pairs) * test_fraction))
    return pairs[n_test:], pairs[:n_test]


class WordTokenizer:
    """Words and punctuation (hyphens are tokens of their own), one vocabulary for both sides.

    ``decode`` rejoins hyphens and closes up punctuation: exact for the built-in task, an
    approximation of the original spacing for other text.
    """

    def __init__(self, words: list[str]):
        self.itos = SPECIALS + [w for w in words if w not in SPECIALS]
        self.stoi = {w: i for i, w in enumerate(self.itos)}

    @classmethod
    def train(cls, texts) -> "WordTokenizer":
        words = sorted({w for t in texts for w in _TOKEN.findall(t)})
        return cls(words)

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def encode(self, text: str) -> list[int]:
        return [self.stoi.get(w, UNK) for w in _TOKEN.findall(text)]

    def decode(self, ids) -> str:
        words = [self.itos[i] for i in ids if i not in (PAD, BOS, EOS)]
        text = " ".join(words)
        return re.sub(r" ([^\w\s])", r"\1", re.sub(r"- ", "-", text))

    def save(self, path: str | os.PathLike) -> None:
        def write(tmp):
            Path(tmp).write_text(json.dumps({"kind": "seq2seq-words", "itos": self.itos}), encoding="utf-8")
        atomic_write(path, write)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "WordTokenizer":
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        return cls(data["itos"][len(SPECIALS):])


def make_batch(pairs: list, tok: WordTokenizer, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Right-padded ``src``, ``src_mask``, decoder input ``tgt`` (``<bos>`` + target) and
    ``targets`` (target + ``<eos>``, ``-100`` on padding)."""
    src = [tok.encode(s) for s, _ in pairs]
    tgt = [tok.encode(t) for _, t in pairs]
    S, T = max(map(len, src)), max(map(len, tgt)) + 1
    out = {"src": torch.full((len(pairs), S), PAD), "tgt": torch.full((len(pairs), T), PAD),
           "targets": torch.full((len(pairs), T), -100)}
    for i, (s, t) in enumerate(zip(src, tgt)):
        out["src"][i, :len(s)] = torch.tensor(s)
        out["tgt"][i, :len(t) + 1] = torch.tensor([BOS] + t)
        out["targets"][i, :len(t) + 1] = torch.tensor(t + [EOS])
    out["src_mask"] = (out["src"] != PAD).long()
    out["tgt_mask"] = (out["targets"] != -100).long()
    return {k: v.to(device) for k, v in out.items()}
