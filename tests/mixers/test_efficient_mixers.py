"""The four efficient-attention mixers through the mixer protocol (tformer.mixers.base).

References: each kernel's dense-mask reference (tests/ops/test_sparse_attention.py) reached through the
mixer's own projections; generation with a state against recomputation of the whole prefix.
"""

import pytest
import torch

from tformer.models import build_model
from tformer.ops.sdpa import scaled_dot_product_attention as sdpa
from tformer.ops.longformer import longformer_mask
from tformer.config import TransformerConfig
from tformer.errors import ConfigError
from tformer.mixers import mixer_class
from tformer.mixers.base import Shared, Step
from tformer.nn.positions import RotaryEmbedding

pytestmark = pytest.mark.usefixtures("one_thread")


def _config(mixer, options=None, **kw):
    base = dict(vocab_size=32, context_length=64, n_layers=2, d_model=32, n_heads=4, positions="rope")
    base.update(kw)
    return TransformerConfig(mixer=mixer, mixer_options={mixer: options or {}}, **base)


def _mixer(config, layer=0):
    torch.manual_seed(0)
    rope = RotaryEmbedding(config.head_dim, config.context_length, config.rope_base) if config.positions == "rope" else None
    return mixer_class(config.layer_mixers()[layer])(config, layer, Shared(rope=rope)).double()


def _step(T, start=0, **kw):
    return Step(positions=torch.arange(start, start + T), start_pos=start, **kw)


@pytest.mark.parametrize("mixer,options,kw", [
    ("longformer", {"window": 5}, {}),
    ("longformer", {"window": [4, 6], "dilation": 2}, {"n_kv_heads": 2}),
    ("longformer", {"window": 8, "global_positions": [0, 9]}, {"causal": False}),
    ("bigbird", {"block_size": 4, "num_random_blocks": 1}, {"causal": False}),
    ("performer", {"features": 16}, {}),
    ("performer", {"features": 16}, {"causal": False, "n_kv_heads": 1}),
    ("linformer", {"k": 8, "sharing": "none"}, {"causal": False}),
    ("linformer", {"k": 8, "sharing": "kv"}, {"causal": False}),
])
def test_count_parameters_and_state_bytes_match_the_module(mixer, options, kw):
    config = _config(mixer, options, **kw)
    for layer in range(config.n_layers):
        m = _mixer(config, layer)
        assert type(m).count_parameters(config) == sum(p.numel() for p in m.parameters())
        state = m.new_state(2, 40, torch.float32)
        held = 0 if state is None else state.nbytes
        # per-layer windows: the class method (config only) reports the largest layer's
        assert type(m).state_bytes(config, 40, 2, 4) == (held if options.get("window") != [4, 6] else 2 * 2 * 2 * 10 * 8 * 4)


def test_longformer_mixer_equals_dense_attention_with_its_mask():
    config = _config("longformer", {"window": 6, "dilation": 2}, n_kv_heads=2)
    m = _mixer(config)
    x = torch.randn(2, 30, 32, dtype=torch.float64)
    step = _step(30)
    q, k, v = m.project(x, step)
    mask = longformer_mask(30, 6, causal=True, dilation=2)
    ref = sdpa(q, k, v, mask=mask, backend="math")                       # GQA handled by sdpa itself
    ref = m.out_proj(ref.transpose(1, 2).reshape(2, 30, 32))
    assert (m(x, step) - ref).abs().max().item() < 1e-10


@pytest.mark.parametrize("mixer,options", [
    ("longformer", {"window": 5}),
    ("longformer", {"window": 4, "dilation": 3}),
    ("performer", {"features": 24, "chunk": 8}),
])
def test_generation_with_a_state_equals_recomputation(mixer, options):
    """Prefill 7 tokens, then 1 at a time, then 4 at once: every output equals the full forward's."""
    config = _config(mixer, options, n_kv_heads=2)
    m = _mixer(config).eval()
    x = torch.randn(2, 23, 32, dtype=torch.float64)
    full = m(x, _step(23))
    state = m.new_state(2, 64, torch.float64)
    outs, start = [], 0
    for T in [7] + [1] * 12 + [4]:
        outs.append(m(x[:, start:start + T], _step(T, start), state))
        start += T
    assert (torch.cat(outs, 1) - full).abs().max().item() < 1e-10
    size = state.nbytes
    m(torch.randn(2, 30, 32, dtype=torch.float64), _step(30, 23), state)
    assert state.nbytes == size                                          # the state does not grow


def test_longformer_ring_buffer_holds_only_the_window():
    config = _config("longformer", {"window": 8})
    state = _mixer(config).new_state(1, 10_000, torch.float32)
    assert state.k.shape == (1, 4, 7, 8)                                 # (B, nkv, w - 1, hs)
    assert type(_mixer(config)).state_bytes(config, 10_000) == state.nbytes


def test_padding_keys_are_ignored():
    """Whatever the padding tokens hold, the real tokens' outputs do not change (for BigBird the
    pattern depends on the padded length, so padding is compared with other padding)."""
    for mixer, options in [("longformer", {"window": 4, "global_positions": [0]}),
                           ("bigbird", {"block_size": 4, "num_random_blocks": 1}),
                           ("performer", {"features": 16}), ("linformer", {"k": 8})]:
        config = _config(mixer, options, causal=False)
        m = _mixer(config).eval()
        x = torch.randn(1, 48, 32, dtype=torch.float64)
        y = x.clone()
        y[:, 40:] = torch.randn(1, 8, 32, dtype=torch.float64)
        mask = torch.ones(1, 1, 1, 48, dtype=torch.bool)
        mask[..., 40:] = False
        a, b = m(x, _step(48, mask=mask)), m(y, _step(48, mask=mask))
        assert (a[:, :40] - b[:, :40]).abs().max().item() < 1e-10, mixer
        if mixer != "bigbird":                                           # same as the row alone
            assert (a[:, :40] - m(x[:, :40], _step(40))).abs().max().item() < 1e-10, mixer


def test_performer_redraws_on_schedule_in_training_only():
    config = _config("performer", {"features": 16, "redraw_interval": 3})
    m = _mixer(config)
    x = torch.randn(1, 8, 32, dtype=torch.float64)
    seen = []
    for _ in range(7):
        seen.append(m.projection.clone())
        m(x, _step(8))
    changed = [not torch.equal(a, b) for a, b in zip(seen, seen[1:])]
    assert changed == [False, False, False, True, False, False]         # calls 1-3 use one draw, 4-6 the next
    m.eval()
    w = m.projection.clone()
    for _ in range(5):
        m(x, _step(8))
    assert torch.equal(w, m.projection)


def test_bigbird_short_input_runs_dense_and_says_why():
    config = _config("bigbird", {"block_size": 4, "num_random_blocks": 1}, causal=False)
    m = _mixer(config)
    x = torch.randn(1, 20, 32, dtype=torch.float64)                      # 20 <= (5 + 2)·4 = 28
    with pytest.warns(UserWarning, match="dense attention is used"):
        out = m(x, _step(20))
    assert m.last_path[0] == "dense"
    q, k, v = m.project(x, _step(20))
    ref = m.out_proj(sdpa(q, k, v, backend="math").transpose(1, 2).reshape(1, 20, 32))
    assert (out - ref).abs().max().item() < 1e-10
    m(torch.randn(1, 40, 32, dtype=torch.float64), _step(40))
    assert m.last_path[0] == "block-sparse"


@pytest.mark.parametrize("mixer,options,kw,words", [
    ("longformer", {"window": 80}, {}, "more than context_length"),
    ("linformer", {"k": 8}, {"causal": True}, "cannot be causal"),
    ("bigbird", {"block_size": 24}, {"causal": False}, "does not divide"),
    ("bigbird", {"block_size": 4}, {"causal": True}, "bidirectional"),
    ("performer", {"feature": 4}, {}, "unknown option"),
    ("performer", {}, {"positions": "alibi"}, "ALiBi"),
])
def test_bad_configs_are_refused_in_one_sentence(mixer, options, kw, words):
    with pytest.raises(ConfigError, match=words) as e:
        build_model(_config(mixer, options, **kw))           # names resolve to classes when a model is built
    assert str(e.value).count(". ") == 0 and str(e.value).endswith(".")


def test_causal_longformer_with_global_tokens_refuses_a_state():
    m = _mixer(_config("longformer", {"window": 4, "global_positions": [0]}))
    with pytest.raises(ConfigError, match="global"):
        m.new_state(1, 32)


@pytest.mark.parametrize("mixer, options, causal", [
    ("longformer", {"window": 4}, True), ("longformer", {"window": 4, "dilation": 2}, False),
    ("longformer", {"window": [4, 2], "global_positions": [0, 5]}, False),
    ("bigbird", {"block_size": 4, "num_random_blocks": 1}, False),
    ("bigbird", {"block_size": 8, "num_random_blocks": 1}, False),          # 64 tokens: the dense fallback
    ("performer", {"features": 6, "chunk": 8}, True), ("performer", {"features": 6}, False),
    ("linformer", {"k": 8}, False), ("linformer", {"k": 8, "sharing": "none"}, False)])
def test_sparse_mixers_report_the_matmuls_they_run(mixer, options, causal):
    """Reference: torch's FlopCounterMode over one forward of the mixer (every matmul it runs),
    times 3 for the backward, equals 6 · its parameters + its extra_training_flops_per_token."""
    from torch.utils.flop_counter import FlopCounterMode
    from tformer.models import build_model

    T = 64
    c = TransformerConfig(model="decoder" if causal else "encoder", vocab_size=40, context_length=T, n_layers=2,
                          d_model=32, n_heads=4, positions="none", bias=False, qkv_bias=False, causal=causal,
                          mixer=mixer, mixer_options={mixer: options})
    model = build_model(c).eval()
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.randint(0, 40, (1, T)))
    counts = counter.get_flop_counts()
    cls = mixer_class(mixer)
    for layer in range(2):
        measured = sum(next(v for k, v in counts.items() if k.endswith(f"blocks.{layer}.attn")).values())
        assert 3 * measured == T * (6 * cls.count_parameters(c) + cls.extra_training_flops_per_token(c, T, layer=layer))


def test_longformer_flops_by_hand():
    """w = 4, bidirectional: each query block of 4 sees a span of 4 + 2·3 = 10 keys; 2 global tokens add
    2 keys to every query and 2 rows over all T keys: 12 · (4 heads · 8) · (10 + 2·2) FLOPs per token."""
    from tformer.accounting import count_parameters, training_flops_per_token
    c = TransformerConfig(model="encoder", vocab_size=40, context_length=64, n_layers=1, d_model=32, n_heads=4,
                          causal=False, mixer="longformer", mixer_options={"longformer": {"window": 4,
                                                                                        "global_positions": [0, 5]}})
    six_n = 6 * (count_parameters(c).non_embedding + 40 * 32)
    assert training_flops_per_token(c) - six_n == 12 * 32 * 14
