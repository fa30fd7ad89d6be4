"""The token-mixer seam: a new mixer is one class plus one registration, and then training,
generation with state, checkpoints and accounting work with it unchanged.

The toy mixer is the causal mean of the past, y_t = W_o · mean(W_v x_1 .. W_v x_t): the smallest
mixer that lets tokens talk, with a fixed-size state (a running sum and a count). References: the
same model run without state (full recomputation), closed forms for the accounting, and the
model's own parameters counted by PyTorch.
"""

import math

import pytest
import torch
import torch.nn as nn

from tformer import (DecoderLM, TransformerConfig, count_parameters, generate, load_model, register_mixer, save_model,
                     state_bytes)
from tformer.models import build_model
from tformer.generation.step import decode_logits, prefill
from tformer.mixers import MIXERS
from tformer.nn.markers import mark_residual

pytestmark = pytest.mark.usefixtures("one_thread")


class MeanState:
    """Running sum ``(B, C)`` and count ``(B,)`` of the values seen so far."""

    def __init__(self, batch_size, d, dtype, device):
        self.sum = torch.zeros(batch_size, d, dtype=dtype, device=device)
        self.count = torch.zeros(batch_size, dtype=dtype, device=device)

    def reset(self):
        self.sum.zero_()
        self.count.zero_()

    @property
    def nbytes(self):
        return self.sum.nbytes + self.count.nbytes


class MeanOfPast(nn.Module):
    def __init__(self, config, layer, shared):
        super().__init__()
        self.v = nn.Linear(config.d_model, config.d_model, bias=False)
        self.out = mark_residual(nn.Linear(config.d_model, config.d_model, bias=False))

    @classmethod
    def count_parameters(cls, config):
        return 2 * config.d_model ** 2

    @classmethod
    def state_bytes(cls, config, n_tokens, batch_size=1, bytes_per_element=4):
        return (config.d_model + 1) * bytes_per_element * batch_size       # independent of n_tokens

    def new_state(self, batch_size, max_len, dtype=torch.float32, device=None):
        return MeanState(batch_size, self.v.in_features, dtype, device)

    def forward(self, x, step, state=None):
        v = self.v(x)                                                       # (B, T, C)
        real = step.tokens.to(v.dtype) if step.tokens is not None else torch.ones(v.shape[:2], dtype=v.dtype)
        total = (v * real[..., None]).cumsum(1)                             # (B, T, C)
        count = real.cumsum(1)                                              # (B, T)
        if state is not None:
            total, count = total + state.sum[:, None], count + state.count[:, None]
            state.sum.copy_(total[:, -1])
            state.count.copy_(count[:, -1])
        return self.out(total / count.clamp(min=1)[..., None])


@pytest.fixture(autouse=True)
def mean_mixer():
    register_mixer("mean", MeanOfPast)           # the one registration
    yield
    MIXERS.pop("mean")


def config(mixer="mean", **kw):
    return TransformerConfig(**{**dict(vocab_size=50, context_length=24, n_layers=2, d_model=16, n_heads=2,
                                       positions="rope"), "mixer": mixer, **kw})


def model_of(c, seed=0):
    torch.manual_seed(seed)
    m = DecoderLM(c).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(30)             # sharp distributions: no greedy near-ties
    return m


@pytest.mark.parametrize("mixer", ["mean", ["mean", "attention"]], ids=["mean", "hybrid"])
def test_accounting_equals_the_built_model(mixer):
    c = config(mixer)
    m = model_of(c)
    assert count_parameters(c).total == m.num_parameters()
    state = m.new_state(3, 20)
    assert state_bytes(c, 20, 3) == state.nbytes
    if mixer == "mean":                        # a fixed-size state: it does not grow with the text
        assert state_bytes(c, 10_000, 3) == state_bytes(c, 20, 3) == 2 * (16 + 1) * 4 * 3


def test_residual_projection_init_by_role_not_by_name():
    c = config(init_std=0.2, n_layers=8, d_model=64)
    m = DecoderLM(c)
    out_std = torch.cat([b.attn.out.weight.flatten() for b in m.blocks]).std().item()
    v_std = torch.cat([b.attn.v.weight.flatten() for b in m.blocks]).std().item()
    assert out_std == pytest.approx(0.2 / math.sqrt(16), rel=0.03)     # marked: scaled by 1/sqrt(2·n_layers)
    assert v_std == pytest.approx(0.2, rel=0.03)                        # not marked: plain init


@pytest.mark.parametrize("mixer", ["mean", ["mean", "attention"]], ids=["mean", "hybrid"])
def test_generation_with_state_equals_recomputation(mixer):
    m = model_of(config(mixer))
    ids = torch.randint(0, 50, (3, 5), generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([[1] * 5, [0, 0, 1, 1, 1], [0, 1, 1, 1, 1]])
    ids = ids * mask
    ref = generate(m, ids, 12, temperature=0, attention_mask=mask, use_cache=False)
    assert torch.equal(generate(m, ids, 12, temperature=0, attention_mask=mask), ref)
    assert torch.equal(generate(m, ids, 12, temperature=0, attention_mask=mask, static=True), ref)
    for i, n in enumerate([5, 3, 4]):             # and left padding changes nothing
        alone = generate(m, ids[i:i + 1, 5 - n:], 12, temperature=0)
        assert torch.equal(alone[0, n:], ref[i, 5:])


def test_trains_saves_and_loads_unchanged(tmp_path):
    from tformer.training.trainer import Trainer

    text = "abcdefghij " * 300
    (tmp_path / "c.txt").write_text(text)
    settings = dict(n_layers=2, d_model=32, n_heads=2, context_length=16, batch_size=8, eval_batches=2,
                    eval_interval=60, log_interval=1, sample_tokens=0, progress=False, threads=1, precision="fp32",
                    max_steps=60, lr=1e-2, warmup_steps=5, mixer="mean", data=str(tmp_path / "c.txt"),
                    out_dir=str(tmp_path / "run"), cache_dir=str(tmp_path / "cache"))
    result = Trainer.create(settings, log=lambda m: None).fit()
    losses = [r["loss"] for r in result["history"] if "loss" in r]
    assert losses[-1] < 0.5 * losses[0]                          # it learns through the mixer
    loaded = load_model(tmp_path / "run").eval()
    assert loaded.config.mixer == "mean" and isinstance(loaded.blocks[0].attn, MeanOfPast)
    save_model(tmp_path / "again", loaded)
    again = load_model(tmp_path / "again").eval()
    ids = torch.randint(0, loaded.config.vocab_size, (2, 10))
    torch.testing.assert_close(again(ids)[0], loaded(ids)[0], atol=0, rtol=0)


def test_static_decode_step_compiles_without_graph_breaks():
    """torch.compile captures one decode step whole: positions and write indices are tensors, the
    static state is preallocated, nothing inside forward reads a tensor's value on the host."""
    for positions in ("learned", "rope", "alibi"):
        c = TransformerConfig(vocab_size=61, context_length=32, n_layers=2, d_model=32, n_heads=4, n_kv_heads=2,
                              positions=positions)
        m = DecoderLM(c).eval()
        state = m.new_state(2, 32, static=True)
        with torch.inference_mode():
            prefill(m, torch.randint(0, 61, (2, 5)), state)
            ex = torch._dynamo.explain(decode_logits)(m, torch.randint(0, 61, (2, 1)), state, torch.full((2, 1), 5))
        assert ex.graph_break_count == 0 and ex.graph_count == 1, (positions, ex.break_reasons)


def test_a_training_forward_compiles_without_graph_breaks():
    """``compile=true`` captures nanoGPT's recipe (learned positions, exact GELU) and the fast one (RoPE,
    ReLU²) whole in training mode, with tformer's CPU kernels in the graph where they build."""
    from tformer.ops import activation_cpu, attention_cpu

    attention_cpu.load()                                         # as the loop does before it compiles
    activation_cpu.load()
    for extra in ({}, {"positions": "rope", "activation": "relu2"}):
        c = TransformerConfig(vocab_size=61, context_length=16, n_layers=2, d_model=32, n_heads=4, **extra)
        m = DecoderLM(c).train()
        ids = torch.randint(0, 61, (2, 16))
        ex = torch._dynamo.explain(lambda x, y: m(x, y)[1])(ids, ids)
        assert ex.graph_break_count == 0 and ex.graph_count == 1, (extra, ex.break_reasons)


def test_unknown_mixer_and_bad_pattern_are_one_sentence():
    from tformer.errors import ConfigError

    with pytest.raises(ConfigError, match="mixer='nope' is not known; choose one of"):
        build_model(config("nope"))
    with pytest.raises(ConfigError, match="length divides n_layers=2"):
        config(["mean", "attention", "mean"])
    with pytest.raises(ConfigError, match="mixer_options names mamba, which no layer uses"):
        config(mixer_options={"mamba": {}})


def test_compiled_decode_is_captured_once_across_steps_and_calls(monkeypatch):
    """Every decode step, of every generation of the same shapes, reuses one compiled graph (a
    counting backend stands in for inductor, so this runs in a second)."""
    from torch._dynamo.testing import CompileCounter

    from tformer.generation import step as gen

    counter = CompileCounter()
    torch._dynamo.reset()
    monkeypatch.setitem(gen._COMPILED, "decode", torch.compile(gen.decode_logits, backend=counter, dynamic=False))
    m = model_of(config("attention"))
    ids = torch.randint(0, 50, (2, 4), generator=torch.Generator().manual_seed(3))
    ref = generate(m, ids, 12, temperature=0)
    assert torch.equal(generate(m, ids, 12, temperature=0, compile=True), ref)
    generate(m, ids, 5, temperature=0, compile=True)       # other lengths: same shapes and strides per step
    generate(m, ids[:1], 30, temperature=0, compile=True)
    generate(m, ids[1:], 9, temperature=0, compile=True)    # another output buffer size: same strides
    assert counter.frame_count == 2                          # batch 2, then batch 1: nothing else recompiles
