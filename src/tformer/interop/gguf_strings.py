"""A GGUF header's string arrays walked in C++ (``gguf_strings.cpp``), built at first use.

A vocabulary's tokens and merges are ~10^5 strings, each a u64 length and its bytes: where the next one
starts is known only once this one's length is read, in Python a loop of several bytecodes a string. The
library walks the run once and returns its bytes with every length field turned into eight NUL bytes; the run is
then decoded as one text and split at those NULs (both in C). Where the library cannot be built (no
compiler, ``TFORMER_NO_EXTENSION=1``), or a string holds a NUL or is not UTF-8, :func:`strings` returns
``None`` and the reader (:mod:`tformer.interop.gguf_reader`) reads string by string, naming any fault.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import torch

from tformer.extensions import build_once, compile_library

SOURCE = Path(__file__).with_name("gguf_strings.cpp")
STATUS: dict[str, str] = {}                    # "state": "built" | "unavailable: <why>"
_LOCK = threading.Lock()
_OP: list = []
SEPARATOR = "\0" * 8                           # a length field, as the library leaves it


def load():
    """``torch.ops.tformer_strings``, built the first time; ``None`` where it cannot be built here."""
    return build_once(lambda: compile_library("tformer_strings", [SOURCE], [], "the GGUF header reader"), _OP, _LOCK,
                      STATUS)


def strings(file: np.ndarray, pos: int, count: int) -> tuple[list[str], int] | None:
    """``(the count strings from byte pos of file, the byte after them)``, or ``None`` where the library is
    not built, the run leaves the file, or a string holds a NUL or is not UTF-8 (``file``: uint8, the whole
    file)."""
    op = load() if count else None
    if op is None:
        return None
    run = op.run(torch.from_numpy(file), pos, count)                  # (bytes of the run,) lengths as NULs
    if not run.numel():
        return None
    try:
        text = str(run.numpy().data, "utf-8")
    except UnicodeDecodeError:
        return None
    if text.count("\0") != len(SEPARATOR) * count:                   # a NUL inside a string: split would lie
        return None
    return text.split(SEPARATOR)[1:], pos + run.numel()
