"""Config validation and the accounting formulas, checked against built models and closed forms."""

import pytest
import torch

from tformer import PRESETS, DecoderLM, TransformerConfig, count_parameters, kv_cache_bytes, training_flops_per_token
from tformer.cli import main as cli_main


def _built_params(config):
    from tformer.models.encoder import EncoderModel
    with torch.device("meta"):  # no memory for gpt2-sized weights
        model = DecoderLM(config) if config.causal else EncoderModel(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", list(PRESETS))
def test_accounting_equals_built_model_for_every_preset(name):
    c = TransformerConfig.from_name(name)
    assert count_parameters(c).total == _built_params(c)


@pytest.mark.parametrize("overrides", [
    dict(ffn="swiglu"), dict(norm="rmsnorm"), dict(bias=False), dict(n_kv_heads=1), dict(n_kv_heads=2),
    dict(tie_embeddings=False), dict(norm_placement="post"), dict(positions="rope"), dict(positions="alibi"),
    dict(bias=False, qkv_bias=True), dict(head_dim=16), dict(d_ff=100, activation="relu"),
    dict(embedding_norm=True),
])
def test_accounting_equals_built_model_for_variants(overrides):
    c = TransformerConfig.from_name("tiny", **overrides)
    assert count_parameters(c).total == _built_params(c)


@pytest.mark.parametrize("heads", [dict(), dict(mlm_head=True, pooler=True)])
def test_accounting_equals_built_encoder(heads):
    from tformer.models.encoder import EncoderModel
    c = TransformerConfig.from_name("bert-mini", type_vocab_size=2, embedding_norm=True)
    model = EncoderModel(c, **heads)
    extra = (c.d_model * c.d_model + c.d_model + 2 * c.d_model + c.vocab_size if heads.get("mlm_head") else 0) \
        + (c.d_model * c.d_model + c.d_model if heads.get("pooler") else 0)  # dense+norm+bias, pooler
    assert count_parameters(c).total + extra == sum(p.numel() for p in model.parameters())


def test_gpt2_small_has_124m_parameters():
    assert count_parameters(TransformerConfig.from_name("gpt2-124m")).total == 124_439_808


@pytest.mark.parametrize("d", [64, 128, 768])
def test_twelve_d_squared_per_layer(d):
    c = TransformerConfig(d_model=d, n_heads=4, bias=False, ffn="mlp", activation="gelu")
    p = count_parameters(c)
    assert p.per_layer_attention == 4 * d * d
    assert p.per_layer_ffn == 8 * d * d
    assert p.per_layer_attention + p.per_layer_ffn == 12 * d * d
    assert p.per_layer_ffn / (p.per_layer_attention + p.per_layer_ffn) == pytest.approx(2 / 3)


def test_training_flops_closed_form():
    c = TransformerConfig(vocab_size=100, context_length=16, n_layers=2, d_model=32, n_heads=4, bias=False)
    n = 2 * 12 * 32 * 32 + 2 * 2 * 32 + 32 + 100 * 32  # layers (12d² + 2 norms), final norm, head matmul
    assert training_flops_per_token(c) == 6 * n + 12 * 2 * 16 * 32
    assert training_flops_per_token(c, seq_len=8) == 6 * n + 12 * 2 * 8 * 32


def test_kv_cache_bytes_formula():
    c = TransformerConfig.from_name("llama-style")  # 8 layers, 2 kv heads of 64
    assert kv_cache_bytes(c, 1000, batch_size=1, bytes_per_element=2) == 2 * 8 * 1000 * 2 * 64 * 2
    mha = TransformerConfig.from_name("llama-style", n_kv_heads=8)
    assert kv_cache_bytes(mha, 1000) == 4 * kv_cache_bytes(c, 1000)


@pytest.mark.parametrize("kwargs,message", [
    (dict(d_model=100, n_heads=3), "d_model=100 is not divisible by n_heads=3"),
    (dict(n_heads=4, n_kv_heads=3), "n_heads=4 is not divisible by n_kv_heads=3"),
    (dict(positions="relative"), "positions='relative' is not known; choose one of none, learned"),
    (dict(norm="batchnorm"), "norm='batchnorm' is not known; choose one of layernorm, rmsnorm"),
    (dict(attention_backend="cuda"), "attention_backend='cuda' is not known; choose one of auto, math, torch"),
    (dict(norm_placement="middle"), "choose one of pre, post"),
    (dict(ffn="moe"), "choose one of mlp, swiglu"),
    (dict(dropout=1.5), "dropout=1.5 must be in"),
    (dict(n_layers=0), "n_layers=0 must be a positive integer"),
    (dict(positions="rope", d_model=36, n_heads=4), "even head_dim"),
])
def test_bad_configs_raise_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TransformerConfig(**kwargs)


def test_unknown_preset_and_keys_are_named():
    with pytest.raises(ValueError, match="unknown preset 'gpt5'; choose one of tiny"):
        TransformerConfig.from_name("gpt5")
    with pytest.raises(ValueError, match="unknown config key.*n_layer\\b.*valid keys are:.*n_layers"):
        TransformerConfig.from_dict({"n_layer": 3})


def test_config_round_trips_through_dict():
    c = TransformerConfig.from_name("llama-style")
    assert TransformerConfig.from_dict(c.to_dict()) == c
    assert c.n_kv_groups == 4 and c.d_ff == 1408


def test_cli_count(capsys):
    assert cli_main(["count", "--preset", "gpt2-124m"]) == 0
    out = capsys.readouterr().out
    assert "124,439,808" in out and "KV cache" in out
