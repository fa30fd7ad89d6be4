"""HuggingFace import/export against transformers itself (a reference nobody here wrote).

For each family a tiny random model is built by transformers from a config (no download), saved with
save_pretrained, imported into tformer, and compared on a right-padded batch in fp32: max abs logit
difference <= 1e-4 on the real (non-padding) positions. Export is checked by loading tformer's
output with from_pretrained: the logits must equal the original model's exactly.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
transformers = pytest.importorskip("transformers", reason="the optional extra 'hf' (transformers) is not installed")

from tformer.checkpoint import load_model, save_model  # noqa: E402
from tformer.interop.hf import save_hf  # noqa: E402
from tformer.interop.hf import config_from_hf, load_hf

TOL = 1e-4
V = 100


def tiny(kind: str):
    """A randomly initialised tiny transformers model of one family (seeded, weights enlarged)."""
    return _randomize(_build(kind))


def _randomize(model):
    """Weights ~ N(0, 0.3) and norm gains ~ 1 + N(0, 0.2): HF's 0.02 init leaves near-uniform attention
    and tiny logits, under which a wrong position scheme could still pass a 1e-4 test."""
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            is_gain = p.dim() == 1 and name.endswith("weight")
            p.copy_(1 + 0.2 * noise if is_gain else 0.3 * noise)
    return model.eval()


def _build(kind: str):
    T = transformers
    torch.manual_seed(0)
    common = dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96)
    if kind == "gpt2":
        cfg = T.GPT2Config(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return T.GPT2LMHeadModel(cfg)
    if kind == "llama":
        return T.LlamaForCausalLM(T.LlamaConfig(**common, num_key_value_heads=2, rope_theta=5000.0,
                                                max_position_embeddings=128))
    if kind == "mistral":  # window 5 < sequence length 12: the window matters
        return T.MistralForCausalLM(T.MistralConfig(**common, num_key_value_heads=1, sliding_window=5,
                                                    max_position_embeddings=128))
    if kind == "qwen2":
        return T.Qwen2ForCausalLM(T.Qwen2Config(**common, num_key_value_heads=2, tie_word_embeddings=True,
                                                max_position_embeddings=128))
    if kind == "bloom":  # 6 heads: exercises the non-power-of-two ALiBi slopes
        return T.BloomForCausalLM(T.BloomConfig(vocab_size=V, hidden_size=48, n_layer=2, n_head=6))
    if kind == "bert":
        return T.BertForMaskedLM(T.BertConfig(**common, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                              attention_probs_dropout_prob=0.0))
    if kind == "bert-base":  # BertModel with its pooler
        return T.BertModel(T.BertConfig(**common, max_position_embeddings=64))
    raise KeyError(kind)


def batch():
    """3 sequences of lengths 12, 9 and 5, right-padded with id 0."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, V, (3, 12), generator=g)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, 9:], mask[2, 5:] = 0, 0
    return ids.masked_fill(mask == 0, 0), mask


def hf_out(model, ids, mask):
    with torch.no_grad():
        out = model.eval()(input_ids=ids, attention_mask=mask)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def tformer_out(model, ids, mask):
    with torch.no_grad():
        if model.config.causal:
            return model(ids, attention_mask=mask)[0]
        return model.mlm_logits(ids, attention_mask=mask) if model.mlm_head is not None \
            else model(ids, attention_mask=mask)


def max_diff_real(a, b, mask):
    keep = mask.bool()
    return (a[keep] - b[keep]).abs().max().item()


FAMILIES = ["gpt2", "llama", "mistral", "qwen2", "bloom", "bert", "bert-base"]


@pytest.mark.parametrize("kind", FAMILIES)
def test_import_matches_transformers(kind, tmp_path):
    hf_model = tiny(kind)
    hf_model.save_pretrained(tmp_path)
    ours = load_hf(tmp_path)
    ids, mask = batch()
    ref, got = hf_out(hf_model, ids, mask), tformer_out(ours, ids, mask)
    assert got.shape == ref.shape
    diff = max_diff_real(ref, got, mask)
    print(f"{kind}: max |logit difference| = {diff:.2e}")
    assert diff <= TOL
    assert ref[mask.bool()].abs().max() > 1e-3  # the comparison is not between two zero tensors


@pytest.mark.parametrize("kind", ["mistral", "llama", "bloom"])
def test_the_comparison_detects_a_wrong_position_scheme(kind, tmp_path):
    """Negative control: break the window / RoPE base / ALiBi on tformer's side; the difference must
    then exceed the tolerance by far (so the passing comparisons above are not vacuous)."""
    hf_model = tiny(kind)
    hf_model.save_pretrained(tmp_path)
    ours = load_hf(tmp_path)
    for block in ours.blocks:
        if kind == "mistral":
            block.attn.window = None
        elif kind == "bloom":
            block.attn.alibi_slopes.zero_()
    if kind == "llama":
        rope = ours.blocks[0].attn.rope
        rope.inv_freq = rope.inv_freq * 2.0  # base 5000 -> a different one
        rope._build(64)
    ids, mask = batch()
    assert max_diff_real(hf_out(hf_model, ids, mask), tformer_out(ours, ids, mask), mask) > 100 * TOL


@pytest.mark.parametrize("kind", FAMILIES)
def test_round_trip_gives_identical_logits(kind, tmp_path):
    hf_model = tiny(kind)
    hf_model.save_pretrained(tmp_path / "hf")
    ours = load_hf(tmp_path / "hf")
    save_model(tmp_path / "tf", ours)                # and through tformer's own checkpoint
    save_hf(load_model(tmp_path / "tf").eval(), tmp_path / "back")
    reloaded = transformers.AutoConfig.from_pretrained(tmp_path / "back")
    cls = type(hf_model)
    back = cls.from_pretrained(tmp_path / "back", config=reloaded)
    ids, mask = batch()
    a, b = hf_out(hf_model, ids, mask), hf_out(back, ids, mask)
    assert torch.equal(a[mask.bool()], b[mask.bool()])


def test_sharded_index_is_read(tmp_path):
    hf_model = tiny("llama")
    hf_model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    ids, mask = batch()
    assert max_diff_real(hf_out(hf_model, ids, mask), tformer_out(load_hf(tmp_path), ids, mask), mask) <= TOL


def test_export_writes_shards_that_transformers_reads(tmp_path):
    hf_model = tiny("gpt2")
    hf_model.save_pretrained(tmp_path / "hf")
    save_hf(load_hf(tmp_path / "hf"), tmp_path / "out", max_shard_bytes=50_000)
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out")
    ids, mask = batch()
    assert torch.equal(hf_out(hf_model, ids, mask)[mask.bool()], hf_out(back, ids, mask)[mask.bool()])


def test_bert_token_types_and_pooler(tmp_path):
    hf_model = tiny("bert-base").eval()
    hf_model.save_pretrained(tmp_path)
    ours = load_hf(tmp_path)
    ids, mask = batch()
    types = (torch.arange(12) >= 4).long().expand(3, 12).contiguous()
    with torch.no_grad():
        ref = hf_model(input_ids=ids, attention_mask=mask, token_type_ids=types)
        hidden = ours(ids, attention_mask=mask, token_type_ids=types)
        pooled = ours.encode(ids, mask, token_type_ids=types, pooling="pooler", normalize=False)
    assert max_diff_real(ref.last_hidden_state, hidden, mask) <= TOL
    assert (ref.pooler_output - pooled).abs().max() <= TOL


def _edit_config(folder, **changes):
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


@pytest.mark.parametrize("kind, changes, field", [
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "rope_type"),
    ("llama", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act"),
    ("gpt2", {"activation_function": "quick_gelu"}, "activation_function"),
    ("gpt2", {"model_type": "t5"}, "model_type"),
    ("bert", {"position_embedding_type": "relative_key"}, "position_embedding_type"),
    ("bloom", {"apply_residual_connection_post_layernorm": True}, "apply_residual_connection_post_layernorm"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 4,
               "layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
])
def test_unsupported_config_is_refused_naming_the_field(kind, changes, field, tmp_path):
    tiny(kind).save_pretrained(tmp_path)
    _edit_config(tmp_path, **changes)
    with pytest.raises(ValueError, match=field):
        load_hf(tmp_path)


def test_unexpected_tensor_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file
    tiny("gpt2").save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["transformer.h.0.attn.extra_scale"] = torch.ones(1)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="extra_scale"):
        load_hf(tmp_path)


@pytest.mark.parametrize("same", [True, False])
def test_a_stored_tied_head_must_equal_the_embedding(tmp_path, same):
    from safetensors.torch import load_file, save_file
    tiny("gpt2").save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    wte = tensors["transformer.wte.weight"]
    tensors["lm_head.weight"] = wte.clone() if same else wte + 1
    save_file(tensors, str(tmp_path / "model.safetensors"))
    if same:
        load_hf(tmp_path)
    else:
        with pytest.raises(ValueError, match="tie_word_embeddings"):
            load_hf(tmp_path)


def test_export_refuses_inexpressible_config():
    from tformer import DecoderLM, TransformerConfig
    model = DecoderLM(TransformerConfig(vocab_size=50, d_model=32, n_heads=4, n_layers=1, positions="rope",
                                        norm="layernorm"))
    with pytest.raises(ValueError, match="norm"):
        save_hf(model, "/nonexistent-never-written", model_type="llama")


def test_config_mapping_reads_family_fields():
    c = config_from_hf(tiny("mistral").config.to_dict())
    assert (c.positions, c.norm, c.ffn, c.n_kv_heads, c.sliding_window) == ("rope", "rmsnorm", "swiglu", 1, 5)
    c = config_from_hf(tiny("llama").config.to_dict())
    assert c.rope_base == 5000.0 and not c.tie_embeddings


@pytest.mark.parametrize("kind", ["gpt2", "llama", "mistral", "qwen2", "bloom"])
def test_greedy_decoding_matches_hf_generate(kind, tmp_path):
    """20 greedy tokens from tformer's KV-cached generate, and from a full recomputation each step,
    are token-identical to transformers' generate. Mistral's window of 5 is far shorter than the
    26 tokens generated over, so the window is exercised while decoding."""
    from tformer.generation.generate import generate
    hf_model = tiny(kind)
    hf_model.save_pretrained(tmp_path)
    ours = load_hf(tmp_path)
    prompt = torch.randint(1, V, (2, 6), generator=torch.Generator().manual_seed(5))
    hf_model.generation_config.eos_token_id = None  # no early stop and no EOS suppression: plain argmax
    with torch.no_grad():
        ref = hf_model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20,
                                do_sample=False, pad_token_id=0)
        cached = generate(ours, prompt, 20, temperature=0.0, use_cache=True)
        ids = prompt
        for _ in range(20):
            logits, _ = ours(ids)
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(cached, ref)
    assert ref.shape == (2, 26) and torch.equal(ids, ref)
