"""The fast recipe's model (RoPE, LayerNorm, ReLU² MLP) exports to HuggingFace GPT-NeoX, and with learned
positions to GPT-2 (ReLU² is their ``relu2``); the switches no HF family expresses (QK-norm, logit
soft-cap) are refused by name, not silently dropped."""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
transformers = pytest.importorskip("transformers", reason="the optional extra 'hf' (transformers) is not installed")

from tformer import DecoderLM, TransformerConfig  # noqa: E402
from tformer.errors import CheckpointError, ConfigError  # noqa: E402
from tformer.interop.hf import infer_model_type, load_hf, save_hf  # noqa: E402
from tformer.training.recipes import FAST_MODEL  # noqa: E402

BASE = dict(vocab_size=50, context_length=16, n_layers=2, d_model=32, n_heads=4)


def test_relu_squared_gpt2_exports_with_the_same_logits(tmp_path):
    """transformers' GPT-2 with activation_function=relu2 gives tformer's logits to 1e-5 (fp32)."""
    torch.manual_seed(0)
    model = DecoderLM(TransformerConfig(**BASE, activation="relu2", zero_init_residual=True)).eval()
    with torch.no_grad():                                           # move off the zero init
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    save_hf(model, tmp_path / "hf", model_type="gpt2")
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.activation_function == "relu2"
    ids = torch.randint(0, 50, (2, 16))
    with torch.no_grad():
        assert torch.allclose(hf(ids).logits, model(ids)[0], atol=1e-5)


@pytest.mark.parametrize("switch", [dict(qk_norm=True), dict(logit_softcap=15.0)])
def test_switches_no_family_expresses_are_refused(tmp_path, switch):
    model = DecoderLM(TransformerConfig(**BASE, **switch))
    with pytest.raises(ConfigError, match=next(iter(switch))):
        save_hf(model, tmp_path / "hf", model_type="gpt2")
    assert not (tmp_path / "hf").exists()


def test_relu_squared_is_refused_outside_gpt2(tmp_path):
    model = DecoderLM(TransformerConfig(**BASE, activation="relu2", positions="rope", norm="rmsnorm", bias=False,
                                        tie_embeddings=False))
    with pytest.raises(ConfigError, match="relu2"):
        save_hf(model, tmp_path / "hf", model_type="llama")


def _nudged(model):
    with torch.no_grad():                                           # move off the zero init
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("kw", [dict(bias=False, tie_embeddings=True), dict(bias=True, tie_embeddings=False)])
def test_the_fast_recipes_model_exports_as_gpt_neox_with_the_same_logits(tmp_path, kw):
    """transformers' GPTNeoXForCausalLM (sequential residuals, the whole head rotated) gives tformer's
    logits to 1e-5 (fp32), biases tformer does not have written as zeros; and the folder loads back
    into tformer with the same weights."""
    torch.manual_seed(0)
    model = _nudged(DecoderLM(TransformerConfig(**BASE, **FAST_MODEL, **kw))).eval()
    assert infer_model_type(model.config) == "gpt_neox"
    save_hf(model, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == "GPTNeoXForCausalLM" and hf.config.hidden_act == "relu2"
    ids = torch.randint(0, 50, (2, 16))
    with torch.no_grad():
        ours = model(ids)[0]
        assert torch.allclose(hf(ids).logits, ours, atol=1e-5)
        assert torch.allclose(load_hf(tmp_path / "hf")(ids)[0], ours, atol=1e-6)


@pytest.mark.parametrize("field,value", [("use_parallel_residual", True), ("rotary_pct", 0.25),
                                         ("attention_bias", False)])
def test_neox_checkpoints_tformer_cannot_express_are_refused_by_name(tmp_path, field, value):
    model = DecoderLM(TransformerConfig(**BASE, positions="rope"))
    save_hf(model, tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg[field] = value
    if field == "rotary_pct":
        cfg["rope_parameters"]["partial_rotary_factor"] = value
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=field if field != "rotary_pct" else "partial_rotary_factor"):
        load_hf(tmp_path / "hf")
