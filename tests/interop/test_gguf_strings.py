"""The GGUF header's string arrays (a vocabulary's tokens and merges) as tformer reads them, against gguf-py's
reader of the same bytes: the fast path (every string under 256 bytes, no NUL: decoded at once) and the
one-by-one path it falls back to give the same strings, and a damaged array is refused in one sentence."""

from __future__ import annotations

import struct

import pytest

gguf = pytest.importorskip("gguf", reason="the optional extra 'gguf' is not installed")

from tformer.errors import CheckpointError  # noqa: E402
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
def test_strings_equal_gguf_py(tmp_path, case):
    path = tmp_path / "m.gguf"
    path.write_bytes(header(CASES[case]))
    ours = GGUFFile(path).metadata[KEY]
    field = gguf.GGUFReader(path).fields[KEY]
    theirs = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
    assert ours == theirs == [b.decode() for b in CASES[case]]


def test_both_paths_agree_on_a_vocabulary():
    items = [f"tok{i}".encode() for i in range(3000)] + ["Ġ日本語".encode(), b""]
    raw = memoryview(encoded(items))
    fast, slow = _Cursor(raw, "m.gguf"), _Cursor(raw, "m.gguf")
    got = fast.short_strings(len(items))
    assert got is not None and fast.pos == len(raw)
    slow.short_strings = lambda count: None                               # the one-by-one path only
    assert slow.strings(len(items)) == got == [b.decode() for b in items] and slow.pos == fast.pos


@pytest.mark.parametrize("damage,words", [
    ("not UTF-8", "is not UTF-8"),
    ("not UTF-8 and long", "is not UTF-8"),
    ("cut inside a string", "ends inside its header"),
    ("cut inside a length", "ends inside its header"),
    ("count too large", "ends inside its header"),
])
def test_a_damaged_string_array_is_one_sentence(tmp_path, damage, words):
    items = [b"ok", b"fine", b"\xff\xfe", b"after"] if damage.startswith("not UTF-8") else [b"ok", b"fine", b"last"]
    if damage == "not UTF-8 and long":
        items.append(b"z" * 300)
    data = {"cut inside a string": lambda: header(items, cut=2), "cut inside a length": lambda: header(items, cut=9),
            "count too large": lambda: header(items, count=4)}.get(damage, lambda: header(items))()
    (tmp_path / "m.gguf").write_bytes(data)
    with pytest.raises(CheckpointError) as e:
        GGUFFile(tmp_path / "m.gguf")
    assert words in str(e.value) and len(str(e.value).splitlines()) == 1
