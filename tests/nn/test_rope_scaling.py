"""RoPE scaling's frequencies and attention factor against transformers' own functions
(``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS``), evaluated in float64 (``torch.float`` patched)
to 1e-12 and as transformers runs them (float32) to 1e-6; and the config's refusals."""

from unittest import mock

import pytest
import torch

from tformer.config import TransformerConfig
from tformer.errors import ConfigError
from tformer.nn.positions import RotaryEmbedding
from tformer.nn.rope_scaling import frequencies

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

CASES = [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096, "beta_fast": 16.0,
     "beta_slow": 2.0, "attention_factor": 1.3, "truncate": False},
]


@pytest.mark.parametrize("scaling", CASES, ids=lambda s: s["rope_type"] + str(s["factor"]))
@pytest.mark.parametrize("head_dim, base", [(64, 500000.0), (128, 1e6)])
def test_frequencies_equal_transformers(scaling, head_dim, base):
    hf = transformers.LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                                  max_position_embeddings=131072, rope_parameters={**scaling, "rope_theta": base})
    ours, factor = frequencies(head_dim, base, scaling)
    with mock.patch.object(torch, "float", torch.float64):
        theirs64, their_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf)
    theirs32, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf)
    assert factor == pytest.approx(their_factor, rel=1e-12)
    # YaRN's ramp is float32 in transformers even with torch.float patched (3e-7 there)
    assert torch.allclose(ours, theirs64.double(), rtol=1e-6 if scaling["rope_type"] == "yarn" else 1e-12, atol=0)
    assert torch.allclose(ours.float(), theirs32, rtol=1e-6, atol=0)
    assert not torch.allclose(ours, frequencies(head_dim, base)[0], rtol=1e-3)      # the scaling changed something


def test_tables_carry_the_attention_factor():
    scaling = CASES[2]
    rope, plain = RotaryEmbedding(64, 128, 1e6, scaling), RotaryEmbedding(64, 128, 1e6)
    cos2_sin2 = rope.cos.double() ** 2 + rope.sin.double() ** 2
    assert torch.allclose(cos2_sin2, torch.full_like(cos2_sin2, rope.attention_factor ** 2), rtol=1e-6)
    assert rope.attention_factor > 1 and torch.allclose(plain.cos[:, 0], rope.cos[:, 0] / rope.attention_factor)


@pytest.mark.parametrize("scaling, words", [
    ({"rope_type": "dynamic", "factor": 2.0}, "rope_type is one of"),
    ({"rope_type": "linear"}, "needs the keys factor"),
    ({"rope_type": "linear", "factor": 2.0, "beta_fast": 3.0}, "needs the keys factor"),
    ({"rope_type": "linear", "factor": -2.0}, "must be a number > 0"),
    ({"rope_type": "factors", "factors": [1.0] * 3}, "a list of 32 numbers"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
      "original_max_position_embeddings": 8192}, "must exceed"),
    ("yarn", "must be a dict"),
])
def test_bad_scalings_are_refused_in_one_sentence(scaling, words):
    with pytest.raises(ConfigError, match=words):
        TransformerConfig(positions="rope", d_model=256, n_heads=4, rope_scaling=scaling)


def test_train_settings_build_a_qwen3_style_model():
    """``tformer train --set`` values (strings) give a model with QK-norm gains and YaRN."""
    from tformer.models import build_model
    from tformer.training.config import cast_value

    settings = {"positions": "rope", "norm": "rmsnorm", "ffn": "swiglu", "qk_norm": "true", "qk_norm_gain": "true",
                "head_dim": "48", "rope_scaling": '{"rope_type": "yarn", "factor": 4, '
                                                  '"original_max_position_embeddings": 32}'}
    config = TransformerConfig(**{k: cast_value(k, v) for k, v in settings.items()})
    model = build_model(config)
    assert model.blocks[0].attn.q_norm.weight.shape == (48,) and model.rope.attention_factor > 1
    ids = torch.randint(0, 256, (1, 70))
    logits, _ = model(ids)
    assert torch.isfinite(logits).all()
