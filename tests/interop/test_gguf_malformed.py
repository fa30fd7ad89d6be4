"""Malformed GGUF files (issue 49, items 2, 11, 20, 24): each gets one sentence and exit 2, never a traceback,
a memory bomb or a checkpoint that later commands refuse.

The files are written byte by byte here (:func:`gguf_bytes`), since the ``gguf`` writer refuses some of
these damages itself (a duplicated tensor name) and cannot write others (a key given twice, arrays nested
50,000 deep). The base file is a one-layer llama with a 32-token byte-level BPE vocabulary, which converts.
"""

from __future__ import annotations

import struct
import sys

import numpy as np
import pytest

pytest.importorskip("gguf", reason="the optional extra 'gguf' is not installed")
pytest.importorskip("tokenizers")

from tformer.cli import main  # noqa: E402

U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
FMT = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?", U64: "<Q",
       I64: "<q", F64: "<d"}
F32_TYPE = 0


def encode_value(kind: int, value) -> bytes:
    if kind in FMT:
        return struct.pack(FMT[kind], value)
    if kind == STR:
        raw = value.encode("utf-8")
        return struct.pack("<Q", len(raw)) + raw
    if isinstance(value, bytes):                           # an array encoded already
        return value
    item, items = value                                    # an array: (item type, items)
    return struct.pack("<IQ", item, len(items)) + b"".join(encode_value(item, v) for v in items)


def gguf_bytes(kv: list[tuple[str, int, object]], tensors: list[tuple]) -> bytes:
    """A GGUF v3 file: metadata ``(key, type, value)`` in order (duplicates allowed), then tensors
    ``(name, numpy shape, data[, ggml type])`` in order (F32 unless a type is given), aligned to 32 bytes."""
    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv)))
    for key, kind, value in kv:
        out += encode_value(STR, key) + struct.pack("<I", kind) + encode_value(kind, value)
    blobs, offset = [], 0
    for name, shape, data, *kind in tensors:
        raw = data if isinstance(data, bytes) else np.ascontiguousarray(data, np.float32).tobytes()
        out += encode_value(STR, name) + struct.pack("<I", len(shape)) + b"".join(
            struct.pack("<Q", d) for d in reversed(shape)) + struct.pack("<IQ", kind[0] if kind else F32_TYPE, offset)
        blobs.append((offset, raw))
        offset += -(-len(raw) // 32) * 32
    out += b"\0" * (-len(out) % 32)
    start = len(out)
    for at, raw in blobs:
        out += b"\0" * (start + at - len(out)) + raw
    return bytes(out)


TOKENS = ["<|endoftext|>"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["Ġ", "ab", "abc", "Ġa", "<|im_end|>"]
MERGES = ["a b", "ab c", "Ġ a"]
SHAPES = {"token_embd.weight": (32, 64), "output_norm.weight": (64,), "blk.0.attn_norm.weight": (64,),
          "blk.0.attn_q.weight": (64, 64), "blk.0.attn_k.weight": (32, 64), "blk.0.attn_v.weight": (32, 64),
          "blk.0.attn_output.weight": (64, 64), "blk.0.ffn_norm.weight": (64,),
          "blk.0.ffn_gate.weight": (96, 64), "blk.0.ffn_up.weight": (96, 64), "blk.0.ffn_down.weight": (64, 96)}


def base_kv() -> list:
    return [("general.architecture", STR, "llama"), ("llama.context_length", U32, 16),
            ("llama.embedding_length", U32, 64), ("llama.block_count", U32, 1),
            ("llama.feed_forward_length", U32, 96), ("llama.attention.head_count", U32, 4),
            ("llama.attention.head_count_kv", U32, 2), ("llama.attention.layer_norm_rms_epsilon", F32, 1e-5),
            ("tokenizer.ggml.model", STR, "gpt2"), ("tokenizer.ggml.pre", STR, "default"),
            ("tokenizer.ggml.tokens", ARR, (STR, TOKENS)), ("tokenizer.ggml.merges", ARR, (STR, MERGES)),
            ("tokenizer.ggml.token_type", ARR, (I32, [3] + [1] * 30 + [3])),
            ("tokenizer.ggml.bos_token_id", U32, 0), ("tokenizer.ggml.eos_token_id", U32, 31),
            ("tokenizer.chat_template", STR, "{% for m in messages %}{{ m.content }}{% endfor %}")]


def base_tensors() -> list:
    rng = np.random.default_rng(0)
    return [(name, shape, rng.standard_normal(shape).astype(np.float32) * 0.1) for name, shape in SHAPES.items()]


def replace(kv: list, key: str, kind: int | None = None, value=None) -> list:
    """``kv`` with ``key`` given ``kind`` / ``value`` (``kind=None``: without ``key``)."""
    out = [(k, t, v) for k, t, v in kv if k != key]
    return out if kind is None else out + [(key, kind, value)]


def nested(depth: int) -> bytes:
    """An array of one array of one array ... ``depth`` deep, of one int32 (encoded without recursion)."""
    return struct.pack("<IQ", ARR, 1) * depth + struct.pack("<IQi", I32, 1, 1)


def damaged(case: str) -> bytes:
    kv, tensors = base_kv(), base_tensors()
    if case == "nested_50000":
        kv.append(("general.deep", ARR, nested(50_000)))
    elif case == "head_count_0":
        kv = replace(kv, "llama.attention.head_count", U32, 0)
    elif case == "head_count_kv_0":
        kv = replace(kv, "llama.attention.head_count_kv", U32, 0)
    elif case == "embedding_length_string":
        kv = replace(kv, "llama.embedding_length", STR, "64")
    elif case == "block_count_string":
        kv = replace(kv, "llama.block_count", STR, "1")
    elif case == "eps_string":
        kv = replace(kv, "llama.attention.layer_norm_rms_epsilon", STR, "1e-5")
    elif case == "bos_string":
        kv = replace(kv, "tokenizer.ggml.bos_token_id", STR, "0")
    elif case == "zero_size_tensor":
        tensors[0] = ("token_embd.weight", (0, 64), b"")
    elif case == "six_dims_tensor":
        tensors[1] = ("output_norm.weight", (1, 1, 1, 1, 1, 64), tensors[1][2].reshape(1, 1, 1, 1, 1, 64))
    elif case == "merge_unknown_token":
        kv = replace(kv, "tokenizer.ggml.merges", ARR, (STR, MERGES + ["q zz"]))
    elif case == "merge_result_not_a_token":               # the tokenizers library panicked (a BaseException)
        kv = replace(kv, "tokenizer.ggml.merges", ARR, (STR, MERGES + ["a c"]))
    elif case == "merge_without_space":
        kv = replace(kv, "tokenizer.ggml.merges", ARR, (STR, MERGES + ["abc"]))
    elif case == "duplicate_tokens":
        kv = replace(kv, "tokenizer.ggml.tokens", ARR, (STR, TOKENS[:5] + ["a"] + TOKENS[6:]))
    elif case == "missing_tokens":
        kv = replace(kv, "tokenizer.ggml.tokens")
    elif case == "bos_out_of_range":
        kv = replace(kv, "tokenizer.ggml.bos_token_id", U32, 1000)
    elif case == "eos_out_of_range":
        kv = replace(kv, "tokenizer.ggml.eos_token_id", U32, 32)
    elif case == "token_type_longer":
        kv = replace(kv, "tokenizer.ggml.token_type", ARR, (I32, [1] * 40))
    elif case == "token_type_shorter":
        kv = replace(kv, "tokenizer.ggml.token_type", ARR, (I32, [1] * 5))
    elif case == "phi3_token_type_longer":               # Phi-3's rstrip rule reads the types: only after their check
        kv = replace(kv, "general.name", STR, "Phi-3 mini")
        kv = replace(kv, "tokenizer.ggml.token_type", ARR, (I32, [1] * 35 + [3] * 5))
    elif case == "tokens_not_strings":
        kv = replace(kv, "tokenizer.ggml.tokens", ARR, (I32, list(range(32))))
    elif case == "merges_not_list":
        kv = replace(kv, "tokenizer.ggml.merges", STR, "a b")
    elif case == "chat_template_not_string":
        kv = replace(kv, "tokenizer.chat_template", U32, 7)
    elif case == "tokenizer_model_not_string":
        kv = replace(kv, "tokenizer.ggml.model", U32, 2)
    # item 20: duplicates, a type in disguise
    elif case == "duplicate_tensor":
        tensors.append(("blk.0.attn_q.weight", (64, 64), np.zeros((64, 64), np.float32)))
    elif case == "duplicate_key":
        kv.append(("tokenizer.chat_template", STR, "{{ 'hidden' }}"))
    elif case == "token_type_string":
        kv = replace(kv, "tokenizer.ggml.token_type", STR, "3,1,1")
    # item 2: sizes the tensors present cannot back
    elif case == "block_count_huge":
        kv = replace(kv, "llama.block_count", U32, 10**9)
    elif case == "feed_forward_huge":
        kv = replace(kv, "llama.feed_forward_length", U64, 2**40)
    elif case == "embedding_huge":
        kv = replace(kv, "llama.embedding_length", U64, 2**40)
    # item 24: weights and vocabularies later commands would refuse
    elif case == "nan_weight":
        tensors[3][2][5, 7] = np.nan
    elif case == "inf_weight":
        tensors[8][2][0, 0] = np.inf
    elif case == "more_tokens_than_embedding":
        kv = replace(kv, "tokenizer.ggml.tokens", ARR, (STR, TOKENS + ["xyz"]))
        kv = replace(kv, "tokenizer.ggml.token_type", ARR, (I32, [3] + [1] * 30 + [3, 1]))
    elif case == "vocab_size_key_differs":
        kv.append(("llama.vocab_size", U32, 40))
    else:
        raise AssertionError(case)
    return gguf_bytes(kv, tensors)


CASES = {   # case -> words the one sentence must hold
    "nested_50000": "nested", "head_count_0": "llama.attention.head_count", "head_count_kv_0":
    "llama.attention.head_count_kv", "embedding_length_string": "llama.embedding_length",
    "block_count_string": "llama.block_count", "eps_string": "layer_norm_rms_epsilon",
    "bos_string": "tokenizer.ggml.bos_token_id", "zero_size_tensor": "token_embd.weight",
    "six_dims_tensor": "output_norm.weight", "merge_unknown_token": "tokenizer.ggml.merges",
    "merge_without_space": "tokenizer.ggml.merges", "merge_result_not_a_token": "tokenizer.ggml.merges",
    "duplicate_tokens": "tokenizer.ggml.tokens",
    "missing_tokens": "tokenizer.ggml.tokens", "bos_out_of_range": "tokenizer.ggml.bos_token_id",
    "eos_out_of_range": "tokenizer.ggml.eos_token_id", "token_type_longer": "tokenizer.ggml.token_type",
    "token_type_shorter": "tokenizer.ggml.token_type", "phi3_token_type_longer": "tokenizer.ggml.token_type",
    "tokens_not_strings": "tokenizer.ggml.tokens",
    "merges_not_list": "tokenizer.ggml.merges", "chat_template_not_string": "tokenizer.chat_template",
    "tokenizer_model_not_string": "tokenizer.ggml.model",
    "duplicate_tensor": "blk.0.attn_q.weight", "duplicate_key": "tokenizer.chat_template",
    "token_type_string": "tokenizer.ggml.token_type",
    "block_count_huge": "llama.block_count", "feed_forward_huge": "llama.feed_forward_length",
    "embedding_huge": "llama.embedding_length",
    "nan_weight": "blk.0.attn_q.weight", "inf_weight": "blk.0.ffn_gate.weight",
    "more_tokens_than_embedding": "token_embd.weight", "vocab_size_key_differs": "llama.vocab_size",
}


def test_the_undamaged_file_converts_and_chats(tmp_path, capsys):
    (tmp_path / "m.gguf").write_bytes(gguf_bytes(base_kv(), base_tensors()))
    assert main(["convert", "--from-gguf", str(tmp_path / "m.gguf"), "--out", str(tmp_path / "ckpt")]) == 0
    assert main(["generate", "--model", str(tmp_path / "m.gguf"), "--prompt", "ab", "--max-new-tokens", "2"]) == 0


@pytest.mark.parametrize("case", list(CASES))
def test_a_malformed_gguf_gets_one_sentence_and_exit_2(tmp_path, capsys, case):
    (tmp_path / "bad.gguf").write_bytes(damaged(case))
    limit = sys.getrecursionlimit()
    capsys.readouterr()
    for argv in (["convert", "--from-gguf", str(tmp_path / "bad.gguf"), "--out", str(tmp_path / "out")],
                 ["generate", "--model", str(tmp_path / "bad.gguf"), "--prompt", "ab", "--max-new-tokens", "2"]):
        try:
            code = main(argv)
        except BaseException as e:  # noqa: BLE001  a PanicException is a BaseException
            pytest.fail(f"{argv[0]}: {type(e).__name__}: {str(e)[:300]}")
        err = capsys.readouterr().err.strip()
        assert code == 2, (argv[0], err[-2000:])
        assert len(err.splitlines()) == 1 and err.startswith(f"tformer {argv[0]}: error: "), err[-2000:]
        assert CASES[case] in err, err
    assert not (tmp_path / "out").exists()
    assert sys.getrecursionlimit() == limit


def test_a_huge_context_length_builds_no_huge_tables(tmp_path):
    """``context_length = 2**40``: RoPE tables grow to the length used, not to the metadata's."""
    kv = replace(base_kv(), "llama.context_length", U64, 2**40)
    (tmp_path / "m.gguf").write_bytes(gguf_bytes(kv, base_tensors()))
    from tformer.interop.gguf_import import load_gguf

    model = load_gguf(tmp_path / "m.gguf")            # a table of 2**40 positions would fail to allocate here
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]]))
        logits = logits[0] if isinstance(logits, tuple) else logits
    assert logits.shape[-1] == 32 and torch.isfinite(logits).all()
    assert next(m for m in model.modules() if hasattr(m, "ensure")).cos.shape[0] <= 4096


def test_a_rust_panic_while_building_the_vocabulary_is_one_sentence(monkeypatch):
    """The tokenizers library panics (``pyo3_runtime.PanicException``, a BaseException that ``except
    Exception`` lets through) on some vocabularies; whatever the checks above miss ends as a CheckpointError."""
    import tokenizers

    from tformer.errors import CheckpointError
    from tformer.tokenizers import gguf_bpe_tokenizer

    class PanicException(BaseException):
        pass

    def panics(*args, **kwargs):
        raise PanicException("range end index 2 out of range for slice of length 1")

    monkeypatch.setattr(tokenizers.models, "BPE", panics)
    with pytest.raises(CheckpointError, match="cannot be built: range end index"):
        gguf_bpe_tokenizer(TOKENS, MERGES, None, "default")


def q8_0_tensors(nan_in: str | None = None) -> list:
    """:func:`base_tensors` with every layer matrix quantised to Q8_0 by gguf-py (kept as blocks when opened);
    ``nan_in``: that matrix's third block scale made a NaN."""
    import gguf

    out = []
    for name, shape, data in base_tensors():
        if name.startswith("blk.") and len(shape) == 2:
            blocks = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0).reshape(-1, 34)      # (blocks, 34)
            if name == nan_in:
                blocks[2, :2] = np.array([0x7E00], np.uint16).view(np.uint8)
            out.append((name, shape, blocks.tobytes(), int(gguf.GGMLQuantizationType.Q8_0)))
        else:
            out.append((name, shape, data))
    return out


def test_a_nan_block_scale_is_refused_before_the_first_token(tmp_path, capsys):
    """A file whose layer matrices are kept as their Q8_0 blocks (``--dtype auto``) and one of whose block scales
    is a NaN is refused by ``generate`` in one sentence naming the tensor and the count, exit 2; the same file
    with finite scales generates (gguf-py quantises both)."""
    (tmp_path / "ok.gguf").write_bytes(gguf_bytes(base_kv(), q8_0_tensors()))
    assert main(["generate", "--model", str(tmp_path / "ok.gguf"), "--prompt", "ab", "--max-new-tokens", "2",
                 "--verbose"]) == 0
    assert "q8_0" in capsys.readouterr().err                               # the blocks were kept as stored
    (tmp_path / "bad.gguf").write_bytes(gguf_bytes(base_kv(), q8_0_tensors(nan_in="blk.0.ffn_up.weight")))
    assert main(["generate", "--model", str(tmp_path / "bad.gguf"), "--prompt", "ab", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "blk.0.ffn_up.weight" in err and "1 NaN or infinite block scales" in err, err
