"""`tformer convert --to-gguf`, read back by the gguf package's own GGUFReader.

The expected tensors come from the transformers model itself (not from tformer), laid out as
llama.cpp's convert_hf_to_gguf.py lays them out (ggml-org/llama.cpp: GPT2Model transposes the
Conv1D weights; LlamaModel.permute reorders Q/K rows for interleaved RoPE). The metadata keys are
the ones llama.cpp's src/llama-model.cpp reads for LLM_ARCH_GPT2 / LLM_ARCH_LLAMA, listed here.
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

from tformer.cli import main  # noqa: E402

KEYS = {"gpt2": ["context_length", "embedding_length", "feed_forward_length", "block_count",
                 "attention.head_count", "attention.layer_norm_epsilon"],
        "llama": ["context_length", "embedding_length", "feed_forward_length", "block_count",
                  "attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
                  "rope.dimension_count", "rope.freq_base"]}


def bpe_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(["to be or not to be, that is the question"] * 20, trainers.BpeTrainer(
        vocab_size=300, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def export(tmp_path, hf_model, kind, tok=None):
    hf_model.save_pretrained(tmp_path / "hf")
    if tok is not None:
        tok.save(str(tmp_path / "hf" / "tokenizer.json"))
    if not (tmp_path / "ckpt").exists():
        assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")]) == 0
    out = tmp_path / f"m-{kind}.gguf"
    assert main(["convert", "--to-gguf", str(tmp_path / "ckpt"), "--out", str(out), "--type", kind]) == 0
    return gguf.GGUFReader(str(out))


def read_tensors(reader) -> dict[str, np.ndarray]:
    """name -> float32 array in numpy order (rows = GGUF's second dimension), dequantized by gguf."""
    out = {}
    for t in reader.tensors:
        shape = [int(n) for n in reversed(t.shape)]
        out[t.name] = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
    return out


def field(reader, key):
    return reader.fields[key].contents()


def check_close(got: np.ndarray, want: np.ndarray, kind: str, ndim: int) -> None:
    """Exact for f32 (and for 1-D tensors, always f32); otherwise the format's own rounding error."""
    assert got.shape == want.shape
    if kind == "f32" or ndim == 1:
        np.testing.assert_array_equal(got, want)
    elif kind == "f16":                        # 11 significant bits: relative error <= 2^-11
        np.testing.assert_allclose(got, want, rtol=2 ** -11, atol=2 ** -24)
    elif kind == "bf16":                       # 8 significant bits: relative error <= 2^-8
        np.testing.assert_allclose(got, want, rtol=2 ** -8, atol=0)
    elif kind == "q4_0":                       # blocks of 32: d = (the signed value of max |x|) / -8, f16;
        blocks = want.reshape(-1, 32)          # x = (q - 8) d, q in 0..15: -8 d .. 7 d, so values near +8 d
        d = np.abs(blocks).max(axis=1, keepdims=True).astype(np.float64) / 8    # clamp to 7 d (one step);
        bound = d * (1 + 8 * 2 ** -11) + 1e-9  # elsewhere half a step; plus 8 times the f16 rounding of d
        err = np.abs(got.reshape(-1, 32) - blocks)
        assert (err <= bound).all(), (err - bound).max()
    else:                                      # q8_0: blocks of 32 share scale max|x|/127, stored as f16
        blocks = want.reshape(-1, 32)          # x = q * d16 with |q| <= 127: rounding of q, plus 127 times
        d = np.abs(blocks).max(axis=1, keepdims=True).astype(np.float64) / 127   # the f16 rounding of d
        d16 = d.astype(np.float16).astype(np.float64)
        bound = np.maximum(d, d16) / 2 + 127 * np.abs(d16 - d) + 1e-9
        err = np.abs(got.reshape(-1, 32) - blocks)
        assert (err <= bound).all(), (err - bound).max()


@pytest.mark.parametrize("kind", ["f32", "f16", "bf16", "q8_0", "q4_0"])
def test_gpt2_gguf_round_trips_every_tensor_and_has_llama_cpp_keys(tmp_path, kind):
    tok = bpe_tokenizer()
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=tok.get_vocab_size(), n_embd=64, n_layer=2, n_head=4, n_positions=32)).eval()
    reader = export(tmp_path, hf, kind, tok)
    sd = {k: v.numpy() for k, v in hf.state_dict().items()}
    want = {"token_embd.weight": sd["transformer.wte.weight"], "position_embd.weight": sd["transformer.wpe.weight"],
            "output_norm.weight": sd["transformer.ln_f.weight"], "output_norm.bias": sd["transformer.ln_f.bias"]}
    names = {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output", "ln_2": "ffn_norm",
             "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}
    for i in range(2):
        for theirs, ours in names.items():
            w = sd[f"transformer.h.{i}.{theirs}.weight"]
            want[f"blk.{i}.{ours}.weight"] = w.T if w.ndim == 2 else w     # Conv1D (in, out) -> (out, in)
            want[f"blk.{i}.{ours}.bias"] = sd[f"transformer.h.{i}.{theirs}.bias"]
    got = read_tensors(reader)
    written = {t.name: t.tensor_type.name for t in reader.tensors}
    assert all(written[n] == ("F32" if want[n].ndim == 1 else kind.upper()) for n in want)
    assert set(got) == set(want)              # tied head: no output.weight, llama.cpp reuses token_embd
    for name, w in want.items():
        check_close(got[name], w, kind, w.ndim)
    assert field(reader, "general.architecture") == "gpt2"
    for key in KEYS["gpt2"]:
        assert f"gpt2.{key}" in reader.fields, key
    assert field(reader, "gpt2.block_count") == 2 and field(reader, "gpt2.embedding_length") == 64
    assert field(reader, "gpt2.feed_forward_length") == 256
    assert field(reader, "tokenizer.ggml.model") == "gpt2"
    vocab = tok.get_vocab()
    tokens = field(reader, "tokenizer.ggml.tokens")
    assert len(tokens) == tok.get_vocab_size() and all(tokens[i] == s for s, i in vocab.items())
    assert len(field(reader, "tokenizer.ggml.merges")) > 0


def interleaved_rope(x: torch.Tensor, pos: torch.Tensor, base: float) -> torch.Tensor:
    """ggml's normal RoPE mode: rotate pairs (2i, 2i+1) by pos * base^(-2i/d). x: (T, heads, d)."""
    d = x.shape[-1]
    ang = pos[:, None].float() * base ** (-torch.arange(0, d, 2).float() / d)   # (T, d/2)
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]                           # (T, 1, d/2)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)


def test_llama_gguf_q_k_layout_gives_hf_attention_scores(tmp_path):
    """Q/K rows written for interleaved RoPE give, under ggml's RoPE, the attention scores transformers
    computes with its rotate-half RoPE; every other tensor round-trips exactly (f32)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False, rope_theta=10000.0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    reader = export(tmp_path, hf, "f32")
    got = read_tensors(reader)
    sd = {k: v for k, v in hf.state_dict().items() if "rotary" not in k}
    assert len(got) == len(sd)
    x, pos, d = torch.randn(5, 64), torch.arange(5), 16
    for i in range(2):
        wq, wk = (sd[f"model.layers.{i}.self_attn.{p}_proj.weight"] for p in "qk")
        q, k = (x @ wq.T).view(5, 4, d).transpose(0, 1)[None], (x @ wk.T).view(5, 2, d).transpose(0, 1)[None]
        cos, sin = hf.model.rotary_emb(q, pos[None])
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        ref = q[0] @ k[0].repeat_interleave(2, 0).transpose(-1, -2)                     # (heads, T, T)
        gq = interleaved_rope((x @ torch.from_numpy(got[f"blk.{i}.attn_q.weight"]).T).view(5, 4, d), pos, 1e4)
        gk = interleaved_rope((x @ torch.from_numpy(got[f"blk.{i}.attn_k.weight"]).T).view(5, 2, d), pos, 1e4)
        ours = gq.transpose(0, 1) @ gk.transpose(0, 1).repeat_interleave(2, 0).transpose(-1, -2)
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
        for theirs, name in (("self_attn.v_proj", "attn_v"), ("self_attn.o_proj", "attn_output"),
                             ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"), ("mlp.down_proj", "ffn_down"),
                             ("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm")):
            np.testing.assert_array_equal(got[f"blk.{i}.{name}.weight"], sd[f"model.layers.{i}.{theirs}.weight"])
    np.testing.assert_array_equal(got["token_embd.weight"], sd["model.embed_tokens.weight"])
    np.testing.assert_array_equal(got["output.weight"], sd["lm_head.weight"])
    np.testing.assert_array_equal(got["output_norm.weight"], sd["model.norm.weight"])
    assert field(reader, "general.architecture") == "llama"
    for key in KEYS["llama"]:
        assert f"llama.{key}" in reader.fields, key
    assert field(reader, "llama.attention.head_count_kv") == 2 and field(reader, "llama.rope.dimension_count") == 16
    assert field(reader, "tokenizer.ggml.model") == "none"        # no tokenizer in the checkpoint


def test_gguf_refuses_a_family_llama_cpp_layouts_do_not_cover(tmp_path, capsys):
    torch.manual_seed(0)
    hf = transformers.BloomForCausalLM(transformers.BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=4))
    hf.save_pretrained(tmp_path / "hf")
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")]) == 0
    capsys.readouterr()
    assert main(["convert", "--to-gguf", str(tmp_path / "ckpt"), "--out", str(tmp_path / "m.gguf")]) == 2
    err = capsys.readouterr().err.strip()
    assert "bloom" in err and len(err.splitlines()) == 1 and not (tmp_path / "m.gguf").exists()
