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


# divisors exact in float32, as transformers holds them (and Phi-3.5 publishes them)
LONGROPE = {"rope_type": "longrope", "original_max_position_embeddings": 64,
            "short_factor": [1.0 + i / 16 for i in range(8)], "long_factor": [1.0 + 3.0 * i for i in range(8)]}


@pytest.mark.parametrize("extra", [{}, {"attention_factor": 1.3}, {"factor": 8.0}])
def test_longrope_sets_equal_transformers(extra):
    """Both sets and the attention factor against transformers' function (short: no seq_len; long: a seq_len
    past the original), float64 (``.float()`` patched as well) to 1e-12; the default factor from the context."""
    scaling = {**LONGROPE, **extra}
    hf = transformers.Phi3Config(hidden_size=64, num_attention_heads=4, max_position_embeddings=512,
                                 original_max_position_embeddings=64, rope_parameters={**scaling, "rope_theta": 1e4})
    fn = ROPE_INIT_FUNCTIONS["longrope"]
    with mock.patch.object(torch, "float", torch.float64), \
            mock.patch.object(torch.Tensor, "float", lambda t, *a, **k: t.to(torch.float64)):
        short, factor = fn(hf)
        long, _ = fn(hf, seq_len=65)
    ours_short, ours_factor = frequencies(16, 1e4, scaling, context_length=512)
    ours_long, _ = frequencies(16, 1e4, scaling, context_length=512, long=True)
    assert ours_factor == pytest.approx(factor, rel=1e-12) and factor > 1
    assert torch.allclose(ours_short, short.double(), rtol=1e-12, atol=0)
    assert torch.allclose(ours_long, long.double(), rtol=1e-12, atol=0)
    assert not torch.allclose(ours_short, ours_long, rtol=1e-3)


def longrope_model():
    """A 2-layer decoder with :data:`LONGROPE` (original context 64, tables to 512), seeded."""
    from tformer.models import build_model

    torch.manual_seed(0)
    return build_model(TransformerConfig(vocab_size=64, context_length=512, n_layers=2, d_model=64, n_heads=4,
                                         positions="rope", norm="rmsnorm", ffn="swiglu", rope_scaling=LONGROPE)).eval()


def test_longrope_set_follows_the_call_or_the_state():
    """Without a state the call's last position picks the set (transformers' rule); in a state its max_len
    does (llama.cpp's n_ctx), so cached decoding equals recomputation whichever set it holds."""
    from tformer.generation.step import decode_step, prefill

    model = longrope_model()
    short, long, _ = model.rope.longrope
    ids = torch.randint(0, 64, (1, 80))
    with torch.no_grad():
        model(ids[:, :64])
        assert model.rope.inv_freq is short
        full = model(ids)[0][0]                                      # 80 > 64 positions: the long set
        assert model.rope.inv_freq is long
        for max_len, want in ((80, full), (64, model(ids[:, :64])[0][0])):
            n = min(max_len, 80)
            state = model.new_state(1, max_len)
            logits = [prefill(model, ids[:, :10], state)[0]]
            logits += [decode_step(model, ids[:, t:t + 1], state)[0] for t in range(10, n)]
            assert torch.allclose(torch.stack(logits), want[9:n], atol=1e-5), max_len
        in_long_state = model(ids[:, :10], state=model.new_state(1, 100))[0][0]
        assert not torch.allclose(in_long_state, model(ids[:, :10])[0][0], atol=1e-3)   # the state's set, not the call's


def test_longrope_is_refused_without_a_divisor_per_frequency():
    with pytest.raises(ConfigError, match="a list of 32 numbers"):
        TransformerConfig(positions="rope", d_model=256, n_heads=4,
                          rope_scaling={**LONGROPE, "short_factor": [1.0] * 31, "long_factor": [1.0] * 32})


def test_train_settings_build_a_longrope_model():
    from tformer.models import build_model
    from tformer.training.config import cast_value

    value = ('{"rope_type": "longrope", "original_max_position_embeddings": 16, "short_factor": [1, 1, 1, 1], '
             '"long_factor": [1, 2, 4, 8]}')
    config = TransformerConfig(positions="rope", d_model=32, n_heads=4, context_length=64,
                               rope_scaling=cast_value("rope_scaling", value))
    model = build_model(config)
    assert model.rope.attention_factor == pytest.approx((1 + torch.log(torch.tensor(4.0)).item() / torch.log(
        torch.tensor(16.0)).item()) ** 0.5)                          # sqrt(1 + ln(64/16) / ln 16)
    logits, _ = model(torch.randint(0, 256, (1, 40)))
    assert torch.isfinite(logits).all()


def test_longrope_set_is_the_whole_states_in_a_view_of_fewer_keys():
    """A server pool decodes through ``rows(.., keys)`` views whose max_len is a bucket of keys, not the pool's
    context: the set stays the one the state was made for (no switch, no table rebuild, per step)."""
    from tformer.generation.step import decode_step, prefill

    model = longrope_model()
    _, long, _ = model.rope.longrope
    ids = torch.randint(0, 64, (1, 20))
    with torch.no_grad():
        whole = model.new_state(1, 100)                              # 100 > 64: the long set throughout
        logits = [prefill(model, ids[:, :10], whole)[0]]
        logits += [decode_step(model, ids[:, t:t + 1], whole)[0] for t in range(10, 20)]
        pool = model.new_state(1, 100, static=True)                  # as serve.pool's KVPool
        prefill(model, ids[:, :10], pool)
        view = pool.rows(0, 1, 32)                                   # 32 keys <= 64
        cos = model.rope.cos
        got = []
        for t in range(10, 20):
            view.index.fill_(t)
            got.append(decode_step(model, ids[:, t:t + 1], view, positions=torch.tensor([[t]]))[0])
        assert model.rope.inv_freq is long and model.rope.cos is cos
    assert torch.allclose(torch.stack(got), torch.stack(logits[1:]), atol=1e-5)
