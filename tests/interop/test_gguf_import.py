"""GGUF import (`load_gguf`, `tformer convert --from-gguf`) on small files made here.

References, independent of tformer's reader:
- tensor types: transformers' own GGUF dequantiser (``transformers.integrations.gguf.dequant``, torch
  code written apart from the ``gguf`` package's numpy routines tformer uses), and numpy / torch casts for
  F32 / F16 / BF16: equal exactly (both compute ``d * q + m`` in float32 from the same f16 scales);
- models: transformers' GGUF loader (``from_pretrained(dir, gguf_file=...)``, which also undoes
  llama.cpp's Q/K row permutation) on llama, qwen2 and gpt2 files: logits within 1e-4;
- round trip: ``tformer convert --to-gguf`` f32 then ``--from-gguf`` gives back every tensor exactly;
- bad files: one line on stderr naming the problem, exit status 2.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
gguf = pytest.importorskip("gguf", reason="the optional extra 'gguf' is not installed")
transformers = pytest.importorskip("transformers", reason="transformers (dev extra) is not installed")

from tformer.checkpoint import load_model  # noqa: E402
from tformer.cli import main  # noqa: E402
from tformer.interop.gguf_import import load_gguf  # noqa: E402
from tformer.interop.gguf_reader import GGUFFile  # noqa: E402

Q = gguf.GGMLQuantizationType
# f16 fields of each block: (byte offset, count) of the scales that must be finite (the rest is random bits).
SCALES = {Q.Q8_0: [(0, 1)], Q.Q4_0: [(0, 1)], Q.Q4_1: [(0, 2)], Q.Q4_K: [(0, 2)], Q.Q5_K: [(0, 2)],
          Q.Q6_K: [(208, 1)]}


def random_blocks(qtype, rows: int, cols: int, rng) -> np.ndarray:
    """Random quantised bytes ``(rows, row_bytes)`` with finite f16 scales of about 0.01."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    for start, n in SCALES[qtype]:
        scales = (rng.standard_normal((raw.shape[0], n)) * 0.01).astype(np.float16)
        raw[:, start:start + 2 * n] = scales.view(np.uint8)
    return raw.reshape(rows, -1)


def write_gguf(path, arch: str, tensors: dict, metadata: dict | None = None) -> None:
    """A GGUF file with these tensors (name -> (array, raw qtype or None)) and ``{arch}.*`` metadata."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    for name, (a, raw) in tensors.items():
        w.add_tensor(name, a, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"])
def test_tensor_types_equal_an_independent_dequantiser(tmp_path, qtype):
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize

    rng = np.random.default_rng(0)
    rows, cols = 6, 512
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    if qtype == "F32":
        data, raw, want = x, None, x
    elif qtype == "F16":
        data, raw, want = x.astype(np.float16), None, x.astype(np.float16).astype(np.float32)
    elif qtype == "BF16":
        bits = torch.from_numpy(x).to(torch.bfloat16)
        data, raw, want = bits.view(torch.int16).numpy().view(np.uint8).reshape(rows, -1), Q.BF16, bits.float().numpy()
    else:
        data, raw = random_blocks(Q[qtype], rows, cols, rng), Q[qtype]
        want = hf_dequantize(torch.from_numpy(data.reshape(-1).copy()), int(Q[qtype])).numpy().reshape(rows, cols)
    write_gguf(tmp_path / "t.gguf", "llama", {"w.weight": (data, raw)})
    f = GGUFFile(tmp_path / "t.gguf")
    assert f.tensors["w.weight"].type == qtype and f.tensors["w.weight"].shape == (rows, cols)
    got = f.array("w.weight")
    assert np.isfinite(want).all() and np.abs(want).max() > 0
    np.testing.assert_array_equal(got, want)


def bpe_tokenizer():
    """A byte-level BPE of 300 tokens (GPT-2's pre-tokenizer), as HF folders hold them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(["to be or not to be, that is the question 1234"] * 20, trainers.BpeTrainer(
        vocab_size=300, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


# ---------------------------------------------------------------- models through transformers' GGUF loader
def hf_model(arch: str):
    torch.manual_seed(0)
    common = dict(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
                  max_position_embeddings=64)
    if arch == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=320, n_embd=64, n_layer=2, n_head=4)
        # d_ff 4 d and n_positions 1024: transformers' GGUF reader takes neither from the file for gpt2
        return transformers.GPT2LMHeadModel(cfg).eval()
    cls = transformers.LlamaForCausalLM if arch == "llama" else transformers.Qwen2ForCausalLM
    cfg_cls = transformers.LlamaConfig if arch == "llama" else transformers.Qwen2Config
    model = cls(cfg_cls(num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                        **common)).eval()
    with torch.no_grad():                         # RMSNorm weights start at 1: make them matter
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.2)
    return model


def qwen2_gguf(model, path) -> None:
    """A Qwen2 model written the way llama.cpp's converter writes one (no Q/K permutation; names by gguf)."""
    c = model.config
    names = gguf.TensorNameMap(gguf.MODEL_ARCH.QWEN2, c.num_hidden_layers)
    tensors = {names.get_name(k, try_suffixes=(".weight", ".bias")): (v.detach().numpy(), None)
               for k, v in model.state_dict().items()}
    write_gguf(path, "qwen2", tensors, {
        "qwen2.context_length": c.max_position_embeddings, "qwen2.embedding_length": c.hidden_size,
        "qwen2.feed_forward_length": c.intermediate_size, "qwen2.block_count": c.num_hidden_layers,
        "qwen2.attention.head_count": c.num_attention_heads, "qwen2.attention.head_count_kv": c.num_key_value_heads,
        "qwen2.attention.layer_norm_rms_epsilon": float(c.rms_norm_eps), "qwen2.rope.freq_base": 10000.0,
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": [f"t{i}" for i in range(c.vocab_size)]})
    # (a token list: transformers' GGUF reader sizes a qwen2 vocabulary by it)


@pytest.mark.parametrize("arch,kind", [("llama", "q8_0"), ("llama", "f32"), ("gpt2", "f16"), ("qwen2", "f32")])
def test_logits_equal_transformers_gguf_loader(tmp_path, arch, kind):
    model = hf_model(arch)
    path = tmp_path / f"m-{kind}.gguf"
    if arch == "qwen2":
        qwen2_gguf(model, path)
    else:
        model.save_pretrained(tmp_path / "hf")
        bpe_tokenizer().save(str(tmp_path / "hf" / "tokenizer.json"))   # its token list sizes transformers' vocab
        assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")]) == 0
        assert main(["convert", "--to-gguf", str(tmp_path / "ckpt"), "--out", str(path), "--type", kind]) == 0
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                            dtype=torch.float32).eval()
    ours = load_gguf(path)
    ids = torch.randint(0, 320, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids).logits
        got, _ = ours(ids)
    assert want.abs().max() > 0.1
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_to_gguf_from_gguf_round_trip_is_exact(tmp_path, arch):
    model = hf_model(arch)
    model.save_pretrained(tmp_path / "hf")
    tok = bpe_tokenizer()
    tok.save(str(tmp_path / "hf" / "tokenizer.json"))
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "a")]) == 0
    assert main(["convert", "--to-gguf", str(tmp_path / "a"), "--out", str(tmp_path / "m.gguf")]) == 0
    assert main(["convert", "--from-gguf", str(tmp_path / "m.gguf"), "--out", str(tmp_path / "b")]) == 0
    a, b = load_model(tmp_path / "a").state_dict(), load_model(tmp_path / "b").state_dict()
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=0, rtol=0, msg=name)
    from tformer.tokenizers import load_tokenizer
    text = "to be or not to be, that is the question  1234 x"
    assert load_tokenizer(tmp_path / "b").encode(text) == tok.encode(text).ids


# ---------------------------------------------------------------- bad files: one sentence, exit 2
def good_file(path, arch="llama", extra: dict | None = None, more: dict | None = None) -> bytes:
    """A complete one-layer llama file (f32) for the damage tests below; returns its bytes."""
    meta = {f"{arch}.context_length": 16, f"{arch}.embedding_length": 64, f"{arch}.block_count": 1,
            f"{arch}.feed_forward_length": 96, f"{arch}.attention.head_count": 4,
            f"{arch}.attention.head_count_kv": 2, f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
            **(extra or {})}
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (32, 64), "output_norm.weight": (64,), "blk.0.attn_norm.weight": (64,),
              "blk.0.attn_q.weight": (64, 64), "blk.0.attn_k.weight": (32, 64), "blk.0.attn_v.weight": (32, 64),
              "blk.0.attn_output.weight": (64, 64), "blk.0.ffn_norm.weight": (64,),
              "blk.0.ffn_gate.weight": (96, 64), "blk.0.ffn_up.weight": (96, 64), "blk.0.ffn_down.weight": (64, 96)}
    tensors = {name: (rng.standard_normal(shape).astype(np.float32), None) for name, shape in shapes.items()}
    write_gguf(path, arch, {**tensors, **(more or {})}, meta)
    return path.read_bytes()


def patch_tensor_info(data: bytes, name: bytes, *, dim0=None, type_id=None) -> bytes:
    """Change the first dimension or the type of tensor ``name`` in the header's tensor table."""
    i = data.index(name) + len(name)
    n_dims = int.from_bytes(data[i:i + 4], "little")
    dims_at, type_at = i + 4, i + 4 + 8 * n_dims
    out = bytearray(data)
    if dim0 is not None:
        out[dims_at:dims_at + 8] = dim0.to_bytes(8, "little")
    if type_id is not None:
        out[type_at:type_at + 4] = type_id.to_bytes(4, "little")
    return bytes(out)


def convert_error(tmp_path, capsys, data: bytes) -> str:
    (tmp_path / "bad.gguf").write_bytes(data)
    capsys.readouterr()
    assert main(["convert", "--from-gguf", str(tmp_path / "bad.gguf"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("tformer convert: error: "), err
    assert not (tmp_path / "out").exists()
    return err


def test_the_undamaged_file_converts(tmp_path):
    good_file(tmp_path / "m.gguf")
    assert main(["convert", "--from-gguf", str(tmp_path / "m.gguf"), "--out", str(tmp_path / "ckpt")]) == 0
    c = load_model(tmp_path / "ckpt").config
    assert (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.d_ff, c.tie_embeddings) == (1, 64, 4, 2, 96, True)


@pytest.mark.parametrize("damage,words", [
    ("truncated", "truncated"),
    ("header_cut", "ends inside its header"),
    ("magic", "is not a GGUF file"),
    ("unknown_type", "ggml type id 99"),
    ("unsupported_type", "IQ2_XXS"),
    ("shape_too_big", "needs"),
    ("row_not_whole_blocks", "whole blocks"),
    ("empty", "is not a GGUF file"),
])
def test_bad_files_get_one_sentence_and_exit_2(tmp_path, capsys, damage, words):
    data = good_file(tmp_path / "m.gguf")
    if damage == "truncated":
        data = data[:-100]
    elif damage == "header_cut":
        data = data[:60]
    elif damage == "magic":
        data = b"GGUX" + data[4:]
    elif damage == "unknown_type":
        data = patch_tensor_info(data, b"token_embd.weight", type_id=99)
    elif damage == "unsupported_type":
        data = patch_tensor_info(data, b"token_embd.weight", type_id=int(Q.IQ2_XXS), dim0=256)
    elif damage == "shape_too_big":
        data = patch_tensor_info(data, b"token_embd.weight", dim0=128)    # 128 x 32 floats in a 64 x 32 slot
    elif damage == "row_not_whole_blocks":
        data = patch_tensor_info(data, b"token_embd.weight", type_id=int(Q.Q8_0), dim0=40)
    elif damage == "empty":
        data = b""
    err = convert_error(tmp_path, capsys, data)
    assert words in err, err


@pytest.mark.parametrize("arch,extra,key", [
    ("bert", {}, "general.architecture"),
    ("llama", {"llama.rope.scaling.type": "longrope", "llama.rope.scaling.factor": 4.0}, "llama.rope.scaling.type"),
    ("llama", {"llama.rope.scaling.type": "yarn"}, "llama.rope.scaling.factor"),
    ("llama", {"llama.rope.scaling.factor": 4.0}, "llama.rope.scaling.factor"),
    ("llama", {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
               "llama.rope.scaling.yarn_log_multiplier": 0.1}, "llama.rope.scaling.yarn_log_multiplier"),
    ("llama", {"llama.expert_count": 8}, "llama.expert_count"),
    ("llama", {"llama.attention.sliding_window": 4096}, "llama.attention.sliding_window"),
    ("llama", {"llama.rope.dimension_count": 8}, "llama.rope.dimension_count"),
])
def test_metadata_it_cannot_honour_is_refused_naming_the_key(tmp_path, capsys, arch, extra, key):
    data = good_file(tmp_path / "m.gguf", arch, extra)
    err = convert_error(tmp_path, capsys, data)
    assert key in err, err


def test_an_unknown_tensor_is_refused_by_name(tmp_path, capsys):
    data = good_file(tmp_path / "m.gguf", more={"output_extra.weight": (np.ones(8, np.float32), None)})
    err = convert_error(tmp_path, capsys, data)
    assert "output_extra.weight" in err, err


def test_rope_divisors_of_the_wrong_size_are_refused(tmp_path, capsys):
    data = good_file(tmp_path / "m.gguf", more={"rope_freqs.weight": (np.ones(5, np.float32), None)})
    err = convert_error(tmp_path, capsys, data)
    assert "rope_freqs.weight must hold 8" in err, err


def test_the_readers_type_table_is_ggmls():
    """The header is read with tformer's own table of ggml types (the gguf package is imported only to
    dequantise): every entry equals gguf's own id, block size and bytes per block."""
    import gguf

    from tformer.interop.gguf_reader import GGML_TYPES, SUPPORTED

    assert sorted(name for name, _, _ in GGML_TYPES.values()) == sorted(SUPPORTED)
    for type_id, (name, block, size) in GGML_TYPES.items():
        qtype = gguf.GGMLQuantizationType(type_id)
        assert qtype.name == name and gguf.GGML_QUANT_SIZES[qtype] == (block, size), name
