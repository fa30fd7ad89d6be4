"""Reading a GGUF file (llama.cpp's format): its metadata, its tensor table, and each tensor as float32.

A GGUF file is, in order (all integers little-endian)::

    magic "GGUF" | version u32 (2 or 3) | tensor count u64 | metadata count u64
    metadata:  key (string) | value type u32 | value        (strings are u64 length + UTF-8 bytes;
                                                              arrays are item type u32 + u64 count + items)
    tensors:   name (string) | n_dims u32 | dims u64 x n_dims | ggml type u32 | offset u64
    padding to ``general.alignment`` (default 32), then the tensor data, each at its offset.

``dims`` lists the fastest-varying dimension first (ggml's ``ne[0]`` is the row length), so the
numpy shape is ``dims`` reversed: a matrix stored as ``[in, out]`` is the array ``(out, in)``, the
``nn.Linear`` weight. A quantised type packs each row in blocks of ``block_size`` values taking
``type_size`` bytes (``gguf.GGML_QUANT_SIZES``: Q4_1 is 32 values in 20 bytes: an f16 scale d, an f16
minimum m and 32 four-bit q, each value ``d * q + m``), so a tensor takes
``prod(dims) / block_size * type_size`` bytes.

The header is parsed here (not by ``gguf.GGUFReader``) so that every malformed file gets one
sentence naming what is wrong: not a GGUF file, truncated, an unknown tensor type, a tensor whose
bytes do not fit its shape (rows that are not whole blocks, data running past the end of the file
or into the next tensor). Dequantisation is the ``gguf`` package's own (``gguf.quants.dequantize``).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tformer.errors import CheckpointError, InputError
from tformer.interop import gguf_strings
from tformer.quant import pages

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# The tensor types this reader turns into float32 (those gguf.quants can dequantise and published files use).
SUPPORTED = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# ggml type id -> (name, values per block, bytes per block) of the SUPPORTED types, ggml's own numbering
# (tests hold it equal to gguf.GGML_QUANT_SIZES): the header is read without importing the gguf package,
# whose import alone costs a small model's whole load; dequantising still uses it.
GGML_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
              7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
              12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 30: ("BF16", 1, 2)}
# Metadata value types: GGUFValueType id -> struct format of one item (STRING=8 and ARRAY=9 are handled apart).
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
MAX_NESTING = 8          # arrays of arrays: published files use none; a hostile one nests 50,000 deep
MAX_DIMS = 4             # ggml's GGML_MAX_DIMS
# The metadata keys tformer reads, and the Python type each must have ("int": an integer, "number": an
# integer or a float, "ints" / "strs": an array of those); a key under "{arch}." is matched without it.
INT, NUMBER, TEXT, FLAG, INTS, STRS = "an integer", "a number", "a string", "a boolean", "an array of integers", \
    "an array of strings"
NUMBERS = "an array of numbers"
KEY_TYPES = {
    "general.architecture": TEXT, "general.alignment": INT, "tokenizer.ggml.model": TEXT, "tokenizer.ggml.pre": TEXT,
    "tokenizer.ggml.tokens": STRS, "tokenizer.ggml.merges": STRS, "tokenizer.ggml.token_type": INTS,
    "tokenizer.ggml.bos_token_id": INT, "tokenizer.ggml.eos_token_id": INT, "tokenizer.ggml.eot_token_id": INT,
    "tokenizer.ggml.padding_token_id": INT, "tokenizer.ggml.unknown_token_id": INT,
    "tokenizer.ggml.add_bos_token": FLAG, "tokenizer.ggml.add_eos_token": FLAG, "tokenizer.chat_template": TEXT,
    "tokenizer.ggml.scores": NUMBERS, "tokenizer.ggml.add_space_prefix": FLAG,
}
ARCH_KEY_TYPES = {
    "context_length": INT, "embedding_length": INT, "feed_forward_length": INT, "block_count": INT,
    "attention.head_count": (INT, INTS), "attention.head_count_kv": (INT, INTS), "attention.key_length": INT,
    "attention.value_length": INT, "rope.dimension_count": INT, "vocab_size": INT, "expert_count": INT,
    "expert_used_count": INT, "attention.layer_norm_rms_epsilon": NUMBER, "attention.layer_norm_epsilon": NUMBER,
    "rope.freq_base": NUMBER, "rope.scaling.factor": NUMBER, "rope.scaling.type": TEXT,
    "rope.scaling.original_context_length": INT, "rope.scaling.attn_factor": NUMBER, "rope.scaling.finetuned": FLAG,
    "rope.scaling.yarn_attn_factor": NUMBER, "rope.scaling.yarn_beta_fast": NUMBER,
    "rope.scaling.yarn_beta_slow": NUMBER, "rope.scaling.yarn_ext_factor": NUMBER,
    "rope.scaling.yarn_log_multiplier": NUMBER,
}


def _is(value, kind: str) -> bool:
    """Whether a metadata value has the type ``kind`` (a vocabulary's 100k items are checked by their
    Python types at once, not one by one)."""
    if kind in (INTS, STRS, NUMBERS):
        return isinstance(value, list) and set(map(type, value)) <= {INTS: {int}, STRS: {str}, NUMBERS: {int, float}}[kind]
    integer = isinstance(value, int) and not isinstance(value, bool)
    if kind == INT:
        return integer
    if kind == NUMBER:
        return integer or isinstance(value, float)
    if kind == TEXT:
        return isinstance(value, str)
    return isinstance(value, bool) or value in (0, 1)          # FLAG


def _describe(value) -> str:
    if isinstance(value, list):
        return f"an array of {len(value):,} items" + (f" (the first {value[0]!r})" if value else "")
    return f"{type(value).__name__} {value!r}"[:80]


def _gguf():
    """The gguf package (dequantisation, ggml's names of the types tformer does not read)."""
    try:
        import gguf
    except ImportError:
        raise InputError("dequantising a GGUF file's tensors needs the gguf package; install it with "
                         "`pip install 'tformer[gguf]'` (make install does).") from None
    return gguf


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file: ``shape`` in numpy order (dims reversed), ``type`` a ggml type name."""

    name: str
    shape: tuple[int, ...]
    type: str
    offset: int          # absolute, in the file
    nbytes: int


class _Cursor:
    """Reads the header's values in order, refusing to run past the end of the file."""

    def __init__(self, data: memoryview, path: Path):
        self.data, self.pos, self.path = data, 0, path

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.data):
            raise CheckpointError(f"{self.path} ends inside its header (at byte {len(self.data):,}, reading "
                                  f"{n:,} bytes at {self.pos:,}): the file is truncated or damaged; download it again.")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        raw = bytes(self.take(self.scalar("<Q")))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise CheckpointError(f"{self.path}: a string at byte {self.pos - len(raw):,} of the header is not "
                                  f"UTF-8; the file is damaged; download it again.") from None

    def strings(self, count: int) -> list[str]:
        """``count`` strings in a row: a vocabulary's tokens and merges, ~100k of them. Walked in C++
        (:mod:`tformer.interop.gguf_strings`) where that library is built, else one by one in a tight loop
        (the per-string path costs about four times as much), which also names any fault."""
        fast = gguf_strings.strings(np.frombuffer(self.data, np.uint8), self.pos, count)
        if fast is not None:
            out, self.pos = fast
            return out
        data, pos, end, out = self.data, self.pos, len(self.data), []
        length = struct.Struct("<Q").unpack_from
        try:
            for _ in range(count):
                (n,) = length(data, pos)
                pos += 8
                if pos + n > end:
                    break
                out.append(str(data[pos:pos + n], "utf-8"))
                pos += n
        except struct.error:                                   # the length itself runs past the end
            pass
        except UnicodeDecodeError:
            raise CheckpointError(f"{self.path}: a string at byte {pos:,} of the header is not UTF-8; the file is "
                                  f"damaged; download it again.") from None
        self.pos = min(pos, end)
        if len(out) < count:
            self.take(end - self.pos + 1)                       # refuses: truncated
        return out

    def value(self, kind: int, key: str, depth: int = 0):
        if kind in SCALARS:
            return self.scalar(SCALARS[kind])
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            if depth >= MAX_NESTING:
                raise CheckpointError(f"{self.path}: metadata key {key!r} holds arrays nested more than {MAX_NESTING} "
                                      f"deep; no model needs that; the file is damaged or hostile.")
            item, count = self.scalar("<I"), self.scalar("<Q")
            if count > len(self.data) - self.pos:          # every item takes at least one byte
                self.take(count)                            # refuses: truncated
            if item in SCALARS and item != 7:               # numbers: one vectorised read
                fmt = SCALARS[item]
                raw = self.take(count * struct.calcsize(fmt))
                return np.frombuffer(raw, dtype=np.dtype(fmt)).tolist()
            if item == STRING:
                return self.strings(count)
            return [self.value(item, key, depth + 1) for _ in range(count)]
        raise CheckpointError(f"{self.path}: metadata key {key!r} has value type {kind}, which GGUF does not "
                              f"define; the file is damaged or from an unknown GGUF version.")


class GGUFFile:
    """A GGUF file opened for reading: ``metadata`` (key -> value), ``tensors`` (name -> TensorInfo).

    Raises:
        CheckpointError: the file is not GGUF, is truncated, names an unknown tensor type, or holds a
            tensor whose bytes do not fit its shape (one sentence each, naming the tensor or key).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"{self.path} is not a file; pass the path of a .gguf model file.")
        # copy-on-write: block tensors are used in place (no copy), and nothing written to them reaches the file
        self.raw = np.memmap(self.path, dtype=np.uint8, mode="c") if self.path.stat().st_size else np.zeros(0, np.uint8)
        if self.raw.size:            # its pages may be handed back once copied into tiles (never written)
            pages.register(self.raw.ctypes.data, self.raw.size, self.raw._mmap)
        cur = _Cursor(memoryview(self.raw), self.path)
        head = bytes(self.raw[:4])
        if head != MAGIC:
            raise CheckpointError(f"{self.path} is not a GGUF file (it starts with {head!r}, not {MAGIC!r}); "
                                  f"pass a .gguf model file as llama.cpp writes them.")
        cur.take(4)
        version = cur.scalar("<I")
        if version not in VERSIONS:
            raise CheckpointError(f"{self.path} is GGUF version {version}; only versions 2 and 3 are read; "
                                  f"convert it again with a current llama.cpp.")
        n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
        self.metadata: dict = {}
        for _ in range(n_kv):
            key = cur.string()
            value = cur.value(cur.scalar("<I"), key)
            if key in self.metadata:     # llama.cpp and gguf-py refuse it: a reader would see one of the two
                raise CheckpointError(f"{self.path}: metadata key {key!r} is given twice; llama.cpp refuses such a "
                                      f"file (a reader shows one value, another uses the other); the file is damaged.")
            self.metadata[key] = value
        self._check_types()
        infos, names = [], set()
        for _ in range(n_tensors):
            name = cur.string()
            if name in names:
                raise CheckpointError(f"{self.path}: tensor {name!r} is given twice; llama.cpp refuses such a file "
                                      f"(which copy is meant?); the file is damaged.")
            names.add(name)
            n_dims = cur.scalar("<I")
            if not 1 <= n_dims <= MAX_DIMS:
                raise CheckpointError(f"{self.path}: tensor {name!r} claims {n_dims} dimensions (ggml has 1 to "
                                      f"{MAX_DIMS}); the file is damaged; download it again.")
            dims = [cur.scalar("<Q") for _ in range(n_dims)]
            if 0 in dims:
                raise CheckpointError(f"{self.path}: tensor {name!r} has shape {list(reversed(dims))}, with no "
                                      f"values; no model weight is empty; the file is damaged.")
            type_id, offset = cur.scalar("<I"), cur.scalar("<Q")
            infos.append((name, dims, type_id, offset))
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        if alignment <= 0 or alignment & (alignment - 1):
            raise CheckpointError(f"{self.path}: general.alignment={alignment} is not a power of two; the file "
                                  f"is damaged.")
        self.data_start = -(-cur.pos // alignment) * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, dims, type_id, offset in infos:
            self.tensors[name] = self._info(name, dims, type_id, self.data_start + offset)
        self._check_layout()

    def _check_types(self) -> None:
        """Every metadata key tformer reads has the type it is read as (a number given as a string, or
        ``token_type`` as a string, is refused naming the key)."""
        arch = self.metadata.get("general.architecture")
        for key, value in self.metadata.items():
            want = KEY_TYPES.get(key)
            if want is None and isinstance(arch, str) and key.startswith(arch + "."):
                want = ARCH_KEY_TYPES.get(key[len(arch) + 1:])
            if want is None:
                continue
            kinds = want if isinstance(want, tuple) else (want,)
            if not any(_is(value, k) for k in kinds):
                raise CheckpointError(f"{self.path}: GGUF metadata {key} is {_describe(value)}, but it must be "
                                      f"{' or '.join(kinds)}; the file is damaged.")

    def _info(self, name: str, dims: list[int], type_id: int, offset: int) -> TensorInfo:
        if type_id not in GGML_TYPES:
            gguf = _gguf()                                  # a type tformer does not read: name it if ggml knows it
            try:
                known = gguf.GGMLQuantizationType(type_id).name
            except ValueError:
                raise CheckpointError(f"{self.path}: tensor {name!r} has ggml type id {type_id}, which is not a known "
                                      f"tensor type; the file is damaged or needs a newer reader.") from None
            raise CheckpointError(f"{self.path}: tensor {name!r} is stored as {known}, which tformer cannot "
                                  f"dequantise (it reads {', '.join(SUPPORTED)}); use a file of another type.")
        kind, block, size = GGML_TYPES[type_id]
        if not dims or dims[0] % block:
            raise CheckpointError(f"{self.path}: tensor {name!r} has shape {list(reversed(dims))} but {kind} "
                                  f"stores rows in whole blocks of {block} values; the file is damaged.")
        nbytes = math.prod(dims) // block * size
        return TensorInfo(name, tuple(reversed(dims)), kind, offset, nbytes)

    def _check_layout(self) -> None:
        """Each tensor's bytes lie inside the file and end before the next tensor's begin."""
        end_of_file = len(self.raw)
        ordered = sorted(self.tensors.values(), key=lambda t: t.offset)
        for t, after in zip(ordered, ordered[1:] + [None]):
            limit = after.offset if after is not None else end_of_file
            what = f"the next tensor {after.name!r} at byte {limit:,}" if after is not None else \
                f"the end of the file at byte {end_of_file:,}"
            if t.offset + t.nbytes > limit:
                hint = "the file is truncated; download it again" if after is None and \
                    t.offset + t.nbytes > end_of_file else "its shape does not match its data; the file is damaged"
                raise CheckpointError(f"{self.path}: tensor {t.name!r} (shape {list(t.shape)}, {t.type}) needs "
                                      f"{t.nbytes:,} bytes from byte {t.offset:,}, past {what}: {hint}.")

    def field(self, key: str, default=None):
        return self.metadata.get(key, default)

    def array(self, name: str) -> np.ndarray:
        """Tensor ``name`` as float32 in numpy order (``shape``): float types widened by numpy, block types
        dequantised by ``gguf.quants``."""
        t = self.tensors[name]
        raw = np.asarray(self.raw[t.offset:t.offset + t.nbytes])
        if t.type in ("F32", "F16"):
            return raw.view(np.float32 if t.type == "F32" else np.float16).astype(np.float32).reshape(t.shape)
        gguf = _gguf()
        qtype = gguf.GGMLQuantizationType[t.type]
        rows = math.prod(t.shape[:-1])
        out = gguf.quants.dequantize(raw.reshape(rows, -1), qtype)
        return np.ascontiguousarray(out, dtype=np.float32).reshape(t.shape)

    def blocks(self, name: str) -> np.ndarray:
        """Tensor ``name``'s bytes as they are in the file, one row a line: ``(rows, row bytes)`` uint8
        (a view of the file, mapped copy-on-write: a write stays in this process; a quantised row is
        ``K / block_size`` blocks)."""
        t = self.tensors[name]
        rows = math.prod(t.shape[:-1])
        return np.asarray(self.raw[t.offset:t.offset + t.nbytes]).reshape(rows, t.nbytes // rows)
