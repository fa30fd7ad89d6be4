"""The GGUF header's string arrays (a vocabulary's tokens and merges) as tformer reads them, against gguf-py's
reader of the same bytes: the C++ walk (``gguf_strings``: the run decoded at once) and the one-by-one Python
path it falls back to give the same strings, and a damaged array is refused in one sentence by either."""

from __future__ import annotations

import struct

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the optional extra 'gguf' is not installed")

from tformer.errors import CheckpointError  # noqa: E402
from tformer.interop import gguf_strings  # noqa: E402
from tformer.interop.gguf_reader import GGUFFile, _Cursor  # noqa: E402

KEY = "tokenizer.ggml.tokens"


def encoded(items: list[bytes]) -> bytes:
    return b"".join(struct.pack("<Q", len(b)) + b for b in items)


def header(items: list[bytes], count: int | None = None, cut: int = 0) -> bytes:
    """A GGUF v3 file with no tensors and one metadata key: an array of strings (``count`` claimed, ``cut``
    bytes taken off the end)."""
    key = KEY.encode()
    body = (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
            + struct.pack("<IIQ", 9, 8, len(items) if count is None else count) + encoded(items))
    return body[:len(body) - cut] if cut else body


CASES = {
    "ascii": [b"a", b"b", b"ab", b"hello"],
    "byte-level": ["Ġthe".encode(), "Ċ".encode(), "ĠĠĠĠ".encode(), "é".encode(), "日本".encode(), "🙂".encode()],
    "empty strings": [b"", b"x", b"", b"", b"yz", b""],
    "a string of 255 bytes": [b"a" * 255, b"b"],
    "a string of 256 bytes": [b"a", b"c" * 256, b"d"],                 # a length's second byte: the slow path
    "a string of 70000 bytes": [b"q" * 70000, b"r"],
    "a NUL inside": [b"a\x00b", b"c"],                                   # the separator: the slow path
    "eight NULs": [b"\x00" * 8, b"k"],
    "one string": [b"<|im_end|>"],
}


@pytest.mark.parametrize("case", list(CASES))
def test_strings_equal_gguf_py(tmp_path, case, path):
    path = tmp_path / "m.gguf"
    path.write_bytes(header(CASES[case]))
    ours = GGUFFile(path).metadata[KEY]
    field = gguf.GGUFReader(path).fields[KEY]
    theirs = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
    assert ours == theirs == [b.decode() for b in CASES[case]]


@pytest.fixture(params=["C++", "Python"])
def path(request, monkeypatch):
    """Each reading path in turn: the library's walk (skipped where it cannot be built) and the Python loop."""
    if request.param == "C++" and gguf_strings.load() is None:
        pytest.skip(f"the GGUF header library is not built here: {gguf_strings.STATUS.get('state')}")
    if request.param == "Python":
        monkeypatch.setattr(gguf_strings, "strings", lambda file, pos, count: None)
    return request.param


def test_the_library_walks_a_vocabulary_as_the_loop_reads_it(monkeypatch):
    if gguf_strings.load() is None:
        pytest.skip(f"the GGUF header library is not built here: {gguf_strings.STATUS.get('state')}")
    items = [f"tok{i}".encode() for i in range(3000)] + ["Ġ日本語".encode(), b"", b"w" * 300]
    raw = memoryview(bytearray(b"xyz" + encoded(items) + b"tail"))
    got = gguf_strings.strings(np.frombuffer(raw, np.uint8), 3, len(items))
    assert got is not None and got[0] == [b.decode() for b in items] and got[1] == len(raw) - 4
    assert gguf_strings.strings(np.frombuffer(raw, np.uint8), 3, len(items) + 1) is None     # runs past the end
    monkeypatch.setattr(gguf_strings, "strings", lambda file, pos, count: None)             # the Python loop alone
    slow = _Cursor(raw, "m.gguf")
    slow.pos = 3
    assert slow.strings(len(items)) == got[0] and slow.pos == got[1]


@pytest.mark.parametrize("damage,words", [
    ("not UTF-8", "is not UTF-8"),
    ("not UTF-8 and long", "is not UTF-8"),
    ("cut inside a string", "ends inside its header"),
    ("cut inside a length", "ends inside its header"),
    ("count too large", "ends inside its header"),
])
def test_a_damaged_string_array_is_one_sentence(tmp_path, damage, words, path):
    items = [b"ok", b"fine", b"\xff\xfe", b"after"] if damage.startswith("not UTF-8") else [b"ok", b"fine", b"last"]
    if damage == "not UTF-8 and long":
        items.append(b"z" * 300)
    data = {"cut inside a string": lambda: header(items, cut=2), "cut inside a length": lambda: header(items, cut=9),
            "count too large": lambda: header(items, count=4)}.get(damage, lambda: header(items))()
    (tmp_path / "m.gguf").write_bytes(data)
    with pytest.raises(CheckpointError) as e:
        GGUFFile(tmp_path / "m.gguf")
    assert words in str(e.value) and len(str(e.value).splitlines()) == 1
