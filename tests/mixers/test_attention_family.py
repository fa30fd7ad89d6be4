"""Softmax self-attention, the efficient mixers and cross-attention share one projection layout.

References: the parameter count against the modules' own ``numel`` sums, the head split written
out with ``reshape``/``permute`` (an independent spelling of the same layout), and a cross-attention
that reads its per-request state against one that projects the memory itself; the state-dict
names the checkpoints and the HF converters read, listed by hand.
"""

import pytest
import torch

from tformer.config import TransformerConfig
from tformer.errors import ConfigError, InputError
from tformer.mixers import MIXERS, mixer_class
from tformer.mixers.attention import CrossAttention, CrossMemory, MultiHeadAttention
from tformer.mixers.base import Shared, Step
from tformer.mixers.projected import ProjectedAttention, merge_heads, projection_parameters, split_heads
from tformer.models import build_model
from tformer.nn.positions import RotaryEmbedding

ATTENTION_MIXERS = ["attention", "longformer", "bigbird", "performer", "linformer"]


def _cfg(**kw):
    base = dict(vocab_size=40, context_length=32, n_layers=2, d_model=32, n_heads=4, dropout=0.0)
    return TransformerConfig(**{**base, **kw})


@pytest.mark.parametrize("name", ATTENTION_MIXERS)
def test_every_attention_mixer_is_a_projected_attention(name):
    assert issubclass(mixer_class(name), ProjectedAttention)
    assert mixer_class(name).name == name and name in MIXERS


@pytest.mark.parametrize("kw", [dict(), dict(n_kv_heads=2), dict(n_kv_heads=1, bias=False),
                                dict(bias=False, qkv_bias=True), dict(head_dim=6)])
def test_parameter_formula_matches_the_modules(kw):
    """One formula for self- and cross-attention, checked against what the modules hold."""
    c = _cfg(**kw)
    for module in (MultiHeadAttention(c), CrossAttention(c)):
        held = sum(p.numel() for p in module.parameters())
        assert type(module).count_parameters(c) == projection_parameters(c) == held


def test_split_and_merge_heads_are_the_written_out_layout():
    t = torch.randn(2, 5, 4 * 3)
    heads = split_heads(t, 4)
    torch.testing.assert_close(heads, t.reshape(2, 5, 4, 3).permute(0, 2, 1, 3), rtol=0, atol=0)
    torch.testing.assert_close(merge_heads(heads), t, rtol=0, atol=0)


def test_project_splits_the_fused_matrix_and_rotates_q_and_k():
    """q, k, v come from rows [0, nh·hs), [nh·hs, (nh+nkv)·hs), the rest of qkv_proj; RoPE on q and k only."""
    torch.manual_seed(0)
    c = _cfg(positions="rope", n_kv_heads=2)
    rope = RotaryEmbedding(c.head_dim, 32)
    m = MultiHeadAttention(c, rope=rope)
    x, pos = torch.randn(2, 6, 32), torch.arange(3, 9)
    q, k, v = m.project(x, Step(positions=pos))
    W, b = m.qkv_proj.weight, m.qkv_proj.bias
    ref = [(x @ W[lo:hi].T + b[lo:hi]).reshape(2, 6, n, 8).permute(0, 2, 1, 3)
           for lo, hi, n in [(0, 32, 4), (32, 48, 2), (48, 64, 2)]]
    torch.testing.assert_close(q, rope(ref[0], pos), atol=1e-6, rtol=0)
    torch.testing.assert_close(k, rope(ref[1], pos), atol=1e-6, rtol=0)
    torch.testing.assert_close(v, ref[2], atol=1e-6, rtol=0)


def test_rope_table_is_used_only_under_rope_positions():
    rope = RotaryEmbedding(8, 32)
    assert MultiHeadAttention(_cfg(positions="rope"), 0, Shared(rope=rope)).rope is rope
    assert MultiHeadAttention(_cfg(positions="learned"), 0, Shared(rope=rope)).rope is None


def test_softmax_attention_takes_what_the_efficient_mixers_refuse():
    kw = dict(positions="alibi", attn_dropout=0.1, sliding_window=8)
    build_model(_cfg(**kw))                                            # no refusal
    for name in ("longformer", "performer"):
        with pytest.raises(ConfigError, match=name):
            build_model(_cfg(mixer=name, **kw))
    with pytest.raises(ConfigError, match="unknown option"):
        build_model(_cfg(mixer_options={"attention": {"window": 4}}))


def test_cross_attention_state_equals_projecting_the_memory():
    """The keys/values projected once per request (``new_state``) give what projecting the memory
    at every call gives, through both ways of passing the context."""
    torch.manual_seed(1)
    c = _cfg(n_kv_heads=2)
    layers = [CrossAttention(c, i) for i in range(2)]
    x, memory = torch.randn(2, 3, 32), torch.randn(2, 7, 32)
    mask = torch.ones(2, 1, 1, 7, dtype=torch.bool)
    mask[0, ..., 5:] = False
    state = CrossMemory(kv=[a.new_state(memory) for a in layers])
    assert state.kv[1][0].shape == (2, 2, 7, 8)
    for a in layers:
        direct = a(x, context=memory, mask=mask)
        torch.testing.assert_close(a(x, context=state, mask=mask), direct, rtol=0, atol=0)
        torch.testing.assert_close(a(x, context=CrossMemory(memory=memory), mask=mask), direct, rtol=0, atol=0)
    with pytest.raises(InputError, match="context"):
        layers[0](x)
    with pytest.raises(InputError, match="context"):
        layers[0](x, context=CrossMemory())


def test_state_dict_names_are_the_converters():
    """The names checkpoints and the HF converters (interop/llama.py, bart.py, marian.py) read."""
    dec = build_model(_cfg())
    assert {k for k in dec.state_dict() if k.startswith("blocks.0.attn.")} == {
        "blocks.0.attn.qkv_proj.weight", "blocks.0.attn.qkv_proj.bias",
        "blocks.0.attn.out_proj.weight", "blocks.0.attn.out_proj.bias"}
    s2s = build_model(_cfg(model="encoder-decoder", positions="sinusoidal", norm_placement="post"))
    names = {k for k in s2s.state_dict() if k.startswith("decoder.blocks.1.")}
    assert {k for k in names if ".cross" in k} == {
        f"decoder.blocks.1.{m}.{p}" for m in ("cross_attn.q_proj", "cross_attn.kv_proj", "cross_attn.out_proj",
                                               "cross_norm") for p in ("weight", "bias")}
    assert not any(".cross" in k for k in s2s.state_dict() if k.startswith("encoder."))
    assert [b.cross_attn.layer for b in s2s.decoder.blocks] == [0, 1]
