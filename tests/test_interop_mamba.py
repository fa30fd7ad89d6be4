"""HF MambaForCausalLM <-> tformer: logits equal to transformers' (1e-4) at several shapes, both
directions; greedy generation token-identical to HF generate; configs HF cannot express refused."""

from __future__ import annotations

import pytest
import torch

from tformer.config import TransformerConfig
from tformer.interop.hf import load_hf, save_hf

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

SHAPES = {
    "default": dict(),
    "small-state-rank5-k4": dict(state_size=4, expand=1, conv_kernel=4, time_step_rank=5),
    "wide-k2-rank1-bias": dict(state_size=16, expand=3, conv_kernel=2, time_step_rank=1, use_bias=True,
                               use_conv_bias=False),
    "untied": dict(tie_word_embeddings=False),
}


def hf_model(seed=0, **kw):
    torch.manual_seed(seed)
    config = transformers.MambaConfig(**{**dict(vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=2,
                                                expand=2, conv_kernel=3, time_step_rank="auto"), **kw})
    return transformers.MambaForCausalLM(config).eval()


@pytest.mark.parametrize("name", list(SHAPES))
def test_import_logits_equal_transformers(tmp_path, name):
    hf = hf_model(**SHAPES[name])
    hf.save_pretrained(tmp_path)
    ours = load_hf(tmp_path)
    assert ours.config.mixer == "mamba" and ours.config.ffn == "none"
    ids = torch.randint(0, 64, (2, 19))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids)[0], hf(ids).logits, atol=1e-4, rtol=1e-4)


def test_export_loads_in_transformers_with_equal_logits(tmp_path):
    hf = hf_model(**SHAPES["wide-k2-rank1-bias"])
    hf.save_pretrained(tmp_path / "hf")
    ours = load_hf(tmp_path / "hf")
    save_hf(ours, tmp_path / "back")
    again = transformers.MambaForCausalLM.from_pretrained(tmp_path / "back").eval()
    ids = torch.randint(0, 64, (2, 13))
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, ours(ids)[0], atol=1e-4, rtol=1e-4)
    for k, v in hf.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k


def test_native_model_exports(tmp_path):
    from tformer.models import build_model
    config = TransformerConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=1, mixer="mamba", ffn="none",
                               positions="none", norm="rmsnorm", bias=False,
                               mixer_options={"mamba": dict(d_state=4, dt_rank=3)})
    torch.manual_seed(0)
    ours = build_model(config).eval()
    save_hf(ours, tmp_path)
    theirs = transformers.MambaForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 64, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids)[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bad", [dict(ffn="mlp"), dict(norm="layernorm"), dict(selective=False)])
def test_export_refuses_what_hf_mamba_cannot_express(tmp_path, bad):
    from tformer.models import build_model
    options = {"selective": bad.pop("selective")} if "selective" in bad else {}
    config = TransformerConfig(**{**dict(vocab_size=64, d_model=32, n_layers=1, n_heads=1, mixer="mamba", ffn="none",
                                         positions="none", norm="rmsnorm", bias=False,
                                         mixer_options={"mamba": options}), **bad})
    with pytest.raises(ValueError, match="cannot export as mamba"):
        save_hf(build_model(config), tmp_path, model_type="mamba")
