"""Corpora: find the text, tokenise it once into a memory-mapped cache, draw batches from it.

A corpus is a text file, a folder of text files (every file below it, sorted) or a glob. With
none, the default is the running interpreter's own standard library: its ``*.py`` files, sorted,
up to :data:`DEFAULT_CORPUS_BYTES` (present on every machine with Python, no download).

Files are read as UTF-8 (or ``encoding``) with invalid bytes replaced by U+FFFD, never a crash,
and the number of bytes replaced is reported, so a latin-1 corpus read as UTF-8 does not go unnoticed.
A file with a NUL byte in its first 8 KiB is binary: a folder or glob skips it (and says how many
it skipped); a binary file given alone is refused. Files are joined with one newline. The last ``val_fraction`` of the tokens (a contiguous tail)
is the validation split, so the split is deterministic and shares no text with training.

Cache: ``<cache_dir>/<key>/`` holds ``tokens.bin`` (uint16 or uint32 ids, read back with
``np.memmap`` so corpora larger than memory work), ``tokenizer.json`` and ``meta.json``; ``key``
hashes the files' contents (SHA-256), the encoding and the tokenizer, so a second run
with the same corpus starts at once and any edited file is tokenised again, whatever its size and
modification time say.
"""

from __future__ import annotations

import codecs
import glob as globlib
import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from tformer.io import atomic_write, atomic_write_json
from tformer.errors import ConfigError, InputError
from tformer.tokenizers import load_tokenizer, train_tokenizer

DEFAULT_CORPUS_BYTES = 4_000_000   # cap of the embedded stdlib corpus (~4 MB of Python source)
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "__pycache__", "idlelib"}
_CHUNK_CHARS = 1 << 20
CACHE_VERSION = 2
_SNIFF_BYTES = 8192
_replaced = {"bytes": 0}  # bytes the decoder could not read, counted by the "tformer-count" error handler


def _count_replaced(e: UnicodeDecodeError) -> tuple[str, int]:
    _replaced["bytes"] += e.end - e.start
    return "\ufffd", e.end


codecs.register_error("tformer-count", _count_replaced)


def is_binary(path: Path) -> bool:
    """A NUL byte in the first 8 KiB: not text (in a byte-oriented encoding such as UTF-8 or latin-1)."""
    with open(path, "rb") as f:
        return b"\x00" in f.read(_SNIFF_BYTES)


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tformer"


def default_corpus_files(max_bytes: int = DEFAULT_CORPUS_BYTES) -> list[Path]:
    """The stdlib's ``*.py`` files in sorted walk order, until ``max_bytes`` (tests and packages skipped)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = Path(dirpath) / name
                size = path.stat().st_size
                if total + size > max_bytes:
                    return files
                files.append(path)
                total += size
    if not files:
        raise InputError(f"found no Python source under {root} for the default corpus; pass --data PATH.")
    return files


def resolve_corpus(data: str | None, encoding: str = "utf-8", log=None) -> list[Path]:
    """The files of a corpus given as a file, a folder or a glob; the default corpus for ``None``.

    Binary files (:func:`is_binary`) are refused when given alone and skipped, with a count sent to
    ``log``, in a folder or glob (not for UTF-16/32 encodings, whose text holds NUL bytes).

    Raises:
        InputError: nothing exists at ``data``, it names no file, a file is unreadable, or the
            files are all binary.
    """
    if data is None or data == "":
        return default_corpus_files()
    path = Path(data).expanduser()
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not any(
            part.startswith(".") for part in p.relative_to(path).parts))
    elif globlib.has_magic(data):
        files = sorted(Path(p) for p in globlib.glob(os.path.expanduser(data), recursive=True) if Path(p).is_file())
    else:
        raise InputError(f"corpus path {data} does not exist; pass a text file, a folder of text files or a glob "
                         f"with --data, or omit --data to use the built-in corpus.")
    if not files:
        raise InputError(f"corpus {data} contains no files; put text files there or pass another --data.")
    for f in files:
        if not os.access(f, os.R_OK):
            raise InputError(f"corpus file {f} is not readable; fix its permissions or leave it out of --data.")
    if codecs.lookup(encoding).name.startswith(("utf-16", "utf-32")):
        return files
    text = [f for f in files if not is_binary(f)]
    if len(files) == 1 and not text:
        raise InputError(f"corpus file {files[0]} is binary (it holds NUL bytes), not text; pass a text file "
                         f"with --data.")
    if not text:
        raise InputError(f"corpus {data} holds only binary files ({len(files)}); pass text files with --data.")
    if len(text) < len(files) and log:
        log(f"skipped {len(files) - len(text)} binary file(s) of {len(files)} in {data} (NUL bytes in them)")
    return text


def iter_text(files: list[Path], encoding: str = "utf-8") -> Iterator[str]:
    """The corpus as text chunks of at most ~1M characters, files joined by one newline; bytes that
    ``encoding`` cannot decode become U+FFFD and are counted in ``_replaced["bytes"]``."""
    for i, path in enumerate(files):
        if i:
            yield "\n"
        with open(path, encoding=encoding, errors="tformer-count", newline="") as f:
            while chunk := f.read(_CHUNK_CHARS):
                yield chunk


def corpus_fingerprint(files: list[Path]) -> str:
    """SHA-256 of the corpus bytes (file contents in order): identifies the corpus for --resume."""
    h = hashlib.sha256()
    for path in files:
        with open(path, "rb") as f:
            while block := f.read(1 << 22):
                h.update(block)
        h.update(b"\x00")
    return h.hexdigest()[:16]


def _content_key(fingerprint: str, encoding: str, tokenizer_id: str) -> str:
    """The cache folder of a corpus: its content, how it is decoded and how it is tokenised."""
    blob = json.dumps({"corpus": fingerprint, "encoding": codecs.lookup(encoding).name,
                       "tokenizer": tokenizer_id, "v": CACHE_VERSION})
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass
class Corpus:
    """A tokenised corpus: ``train`` and ``val`` are 1-D integer arrays (memory-mapped)."""

    train: np.ndarray
    val: np.ndarray
    tokenizer: object
    fingerprint: str
    files: list[Path]
    cache: Path

    @property
    def n_tokens(self) -> int:
        return len(self.train) + len(self.val)


def load_corpus(
    data: str | None,
    *,
    tokenizer: str | object = "char",
    bpe_vocab_size: int = 1024,
    val_fraction: float = 0.1,
    cache_dir: str | os.PathLike | None = None,
    encoding: str = "utf-8",
    log=print,
) -> Corpus:
    """Find, tokenise (or reuse the cache of) and split a corpus.

    Args:
        data: file, folder or glob; ``None`` for the default corpus.
        tokenizer: ``"char"`` or ``"bpe"`` to train one on the corpus, or a tokenizer object
            (from a checkpoint) to encode with.
        val_fraction: share of the tokens, at the end, kept for validation.
        encoding: how the files are decoded; undecodable bytes become U+FFFD and are counted.
    Raises:
        ConfigError: ``val_fraction`` outside (0, 1), or a BPE vocabulary below 256.
        InputError: a missing or empty corpus, or a character vocabulary that cannot encode it.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"val_fraction={val_fraction} must be in (0, 1), e.g. 0.1.")
    files = resolve_corpus(data, encoding, log)
    if sum(p.stat().st_size for p in files) == 0:
        raise InputError(f"corpus {data} is empty (0 bytes); give it some text.")
    def trained_id(kind: str) -> str:
        return f"{kind}-{bpe_vocab_size}" if kind == "bpe" else kind

    root = Path(cache_dir or default_cache_dir())
    fingerprint = corpus_fingerprint(files)
    if isinstance(tokenizer, str):
        cache = root / _content_key(fingerprint, encoding, trained_id(tokenizer))
    else:  # a given tokenizer (resume): reuse the cache of the run that trained it, if it is that one
        cache = root / _content_key(fingerprint, encoding, trained_id(tokenizer.kind))
        try:
            same = json.loads((cache / "tokenizer.json").read_text(encoding="utf-8")) == tokenizer.to_dict()
        except (OSError, ValueError):
            same = False
        if not (same and (cache / "meta.json").is_file()):
            tok_hash = hashlib.sha256(json.dumps(tokenizer.to_dict(), sort_keys=True).encode()).hexdigest()[:16]
            cache = root / _content_key(fingerprint, encoding, tok_hash)
    meta_path = cache / "meta.json"
    if not meta_path.is_file():
        _build_cache(files, tokenizer, bpe_vocab_size, cache, encoding, fingerprint, log)
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    if meta.get("replaced_bytes"):
        log(f"warning: {meta['replaced_bytes']:,} byte(s) of the corpus are not valid {encoding} and were replaced "
            f"by U+FFFD; if the files use another encoding, pass it with --encoding (e.g. --encoding latin-1)")
    tok = load_tokenizer(cache / "tokenizer.json")
    n = meta["n_tokens"]
    ids = np.memmap(cache / "tokens.bin", dtype=np.dtype(meta["dtype"]), mode="r", shape=(n,)) if n else np.zeros(0, np.uint16)
    n_val = int(round(n * val_fraction))
    return Corpus(train=ids[: n - n_val], val=ids[n - n_val:], tokenizer=tok, fingerprint=meta["fingerprint"],
                  files=files, cache=cache)


def _build_cache(files, tokenizer, bpe_vocab_size, cache: Path, encoding: str, fingerprint: str, log) -> None:
    cache.mkdir(parents=True, exist_ok=True)
    n_bytes = sum(p.stat().st_size for p in files)
    if isinstance(tokenizer, str):
        log(f"training a {tokenizer} tokenizer on {len(files)} file(s), {n_bytes / 1e6:.1f} MB ...")
        tokenizer = train_tokenizer(tokenizer, iter_text(files, encoding), bpe_vocab_size)
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
    log(f"tokenising into {cache} (vocab {tokenizer.vocab_size}) ...")
    counter = {"n": 0}

    def write(tmp: str) -> None:
        counter["n"], _replaced["bytes"] = 0, 0
        with open(tmp, "wb") as f:
            for chunk in iter_text(files, encoding):
                ids = tokenizer.encode_array(chunk)
                ids.astype(dtype).tofile(f)
                counter["n"] += len(ids)

    atomic_write(cache / "tokens.bin", write)
    tokenizer.save(cache / "tokenizer.json")
    atomic_write_json(cache / "meta.json", {           # written last: its presence marks a complete cache
        "n_tokens": counter["n"], "dtype": np.dtype(dtype).name, "fingerprint": fingerprint,
        "files": [str(p) for p in files[:1000]], "n_files": len(files), "bytes": n_bytes,
        "vocab_size": tokenizer.vocab_size, "tokenizer": tokenizer.kind, "version": CACHE_VERSION,
        "encoding": encoding, "replaced_bytes": _replaced["bytes"],
    })


def get_batch(data: np.ndarray, batch_size: int, block: int, seed: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` random windows of ``block + 1`` tokens -> inputs and next-token targets.

    The offsets come from a generator seeded with ``seed`` (e.g. ``(run_seed, split, step, micro)``),
    so the batch of a given step is the same in every run and after every resume.

    Returns:
        ``(x, y)``, both ``(batch_size, block)`` int64; ``y`` is ``x`` shifted left by one.
    """
    rng = np.random.default_rng(list(seed))
    starts = rng.integers(0, len(data) - block, size=batch_size)          # last start: len - block - 1
    rows = np.stack([np.asarray(data[s: s + block + 1]) for s in starts]).astype(np.int64)
    t = torch.from_numpy(rows)                                            # (B, block + 1)
    return t[:, :-1], t[:, 1:]
