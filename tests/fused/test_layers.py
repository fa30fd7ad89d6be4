"""Whole layers in one C++ call (tformer.fused) against the module path of the same block-quantised
or float model: logits, KV caches and greedy tokens; and the calls it leaves to the module path.

Tolerance: the products are the same kernels on the same quantised activations, so the two paths
differ only by the float summation order of the RMS norm, softmax and weighted sum (~1e-6
relative), except where that moves an activation across a rounding boundary of its 8-bit
quantisation (one code step, max|x_b| / 127, in one element). Logits must agree to
2e-3 · max|logit| (a code flip in one activation of one product moves a logit by ~1e-4 of its
scale here); the caches to 1e-4 of their scale.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import tformer.fused as whole
from tformer.generation.step import decode_logits, decode_step, prefill
from tformer.quant import kernels, qgemv
from tformer.quant.quantize import set_precision

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "quant"))
from quant_models import tiny, tiny_gemma, tiny_gpt2  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
needs_tiles = pytest.mark.skipif(qgemv.path() not in qgemv.TILE_ROWS, reason="no SIMD tile path on this CPU")


SHAPES = {"llama": tiny, "gpt2": tiny_gpt2, "gemma": tiny_gemma}


def plan_of(model):
    return whole.chosen(model).plan


def decode(model, tokens, state, positions=None, attention_mask=None):
    """What decode_step runs on the whole-layer route, or None where the route is the module path."""
    r = whole.route(model, state, tokens.shape[0], 1, step=True,
                    masked=positions is not None or attention_mask is not None)
    return None if r is None else whole.decode(model, tokens, state, r, positions, attention_mask)


def forward(model, ids, state, **kw):
    """What prefill / extend run on the whole-layer route, or None where the route is the module path."""
    r = whole.route(model, state, *ids.shape)
    return None if r is None else whole.forward(model, ids, state, r, **kw)


def pair(fmt: str, shape: str = "llama"):
    model = set_precision(SHAPES[shape](), fmt)
    ids = torch.tensor([[3, 17, 5, 42, 8, 11, 2], [9, 1, 30, 7, 7, 60, 4]])
    states = [model.new_state(2, 40) for _ in range(2)]
    with torch.inference_mode():
        for s in states:
            prefill(model, ids, s)
    return model, states


@needs_tiles
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("path", sorted(qgemv.TILE_ROWS))
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1", "fp32"])
def test_fused_equals_module_path(fmt, path, shape, monkeypatch):
    """Block formats: the rule in the module docstring. fp32 weights (the float loops of float_rows.h)
    differ from the module path only in float summation order, well inside the same bound."""
    if path not in qgemv.paths():
        pytest.skip(f"this CPU does not run {path}")
    monkeypatch.setenv(qgemv.FORCED, path)
    model, (fused, plain) = pair(fmt, shape)
    assert plan_of(model) is not None, whole.chosen(model).reason
    tok = torch.tensor([[5], [6]])
    with torch.inference_mode():
        for _ in range(12):                                  # positions 7 .. 18: attention over a growing cache
            a = decode(model, tok, fused)
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
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("fmt", ["q8_0", "q4_1", "fp32"])
def test_fused_static_rows_equal_module_path(fmt, shape):
    """The server's pool: a static state, row 0 left-padded (2 fewer real tokens), decoded through a
    view of both rows and the first 24 keys, with explicit per-row positions, as KVPool.decode does
    (GPT-2's learned positions are looked up at those positions, RoPE rotates at them)."""
    model = set_precision(SHAPES[shape](), fmt)
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
            a = decode(model, tok, fused.rows(0, 2, keys=24), positions=at[:, None])
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
    real = torch.ops.tformer_fused.layer
    monkeypatch.setattr(whole, "decode", lambda *a, _d=whole.decode, **kw: calls.append(1) or _d(*a, **kw))
    with torch.inference_mode():
        decode_step(model, torch.tensor([[1], [2]]), state)
        assert calls and state.length == 8
        # on an eager state an attention mask or explicit positions go to the module path
        assert decode(model, torch.tensor([[1], [2]]), state, attention_mask=torch.ones(2, 1)) is None
        assert decode(model, torch.tensor([[1], [2]]), state, positions=torch.tensor([[8], [8]])) is None
        static = model.new_state(2, 40, static=True)
        prefill(model, torch.tensor([[1, 2], [3, 4]]), static)
        n = len(calls)
        decode_step(model, torch.tensor([[1], [2]]), static)          # a static step: fused, length kept
        assert len(calls) == n + 1 and static.length == 3 and static.index.tolist() == [3, 3]
        monkeypatch.setenv(whole.SWITCH, "0")
        assert whole.chosen(model).plan is not None          # read when the choice is made, not per call
        assert whole.choose(model).reason == f"module path: {whole.SWITCH}=0"
        assert decode(model, torch.tensor([[1], [2]]), state) is None
    assert real is torch.ops.tformer_fused.layer


def test_plan_names_what_it_does_not_implement():
    model = tiny()                                           # float weights: not block products
    assert plan_of(model) is None and "BlockLinear" in whole.chosen(model).reason
    from tformer import DecoderLM, TransformerConfig
    gpt = set_precision(DecoderLM(TransformerConfig(vocab_size=61, context_length=16, n_layers=1, d_model=64,
                                                    n_heads=2, qk_norm=True)).eval(), "q8_0")
    assert plan_of(gpt) is None and whole.chosen(gpt).reason == "module path: QK-norm without gains"


@needs_tiles
def test_the_choice_is_made_once_and_again_when_the_model_changes(monkeypatch):
    """chosen() keeps the choice: no check runs again per call, the switch is read when it is made;
    train() / eval() and set_precision swapping the products make it again."""
    import tformer.fused.plan as plan_module

    model = tiny()
    assert whole.chosen(model).plan is None                  # float nn.Linear products
    set_precision(model, "q8_0")                             # in place: new product modules
    first = whole.chosen(model)
    assert first.plan is not None
    assert first.reason == f"whole layers in one C++ call ({qgemv.path()} kernels, q8_0 blocks)", first.reason
    checks = []
    monkeypatch.setattr(plan_module, "why_not", lambda m, _w=plan_module.why_not: checks.append(1) or _w(m))
    monkeypatch.setenv(whole.SWITCH, "0")
    assert whole.chosen(model) is first and checks == []     # cached: neither the checks nor the switch read
    model.train()
    assert whole.chosen(model).reason == f"module path: {whole.SWITCH}=0" and checks == [1]
    monkeypatch.setenv(whole.SWITCH, "1")
    assert whole.chosen(model).reason == f"module path: {whole.SWITCH}=0"   # kept until the model changes
    assert whole.choose(model).reason == "module path: training mode"      # or it is made again by hand
    model.eval()
    assert whole.chosen(model).plan is not None and checks == [1, 1, 1]


@needs_tiles
def test_held_padding_is_a_flag_of_the_state():
    """A masked call marks the state (its views and mapped copies too); reset forgets it; the calls
    without a mask and the pool's writer leave it clear, so they are never asked to read valid back."""
    model, (state, _) = pair("q8_0")
    assert not state.padded and not state.rows(0, 1).padded
    with torch.inference_mode():
        prefill(model, torch.tensor([[0, 3], [5, 6]]), state, attention_mask=torch.tensor([[0, 1], [1, 1]]))
    assert state.padded and state.rows(0, 1).padded and state.map(lambda t: t).padded
    assert not state.writer(torch.tensor([0]), 2).padded
    state.reset()
    assert not state.padded


@needs_tiles
def test_smollm2_steps_track_the_module_path(monkeypatch, smollm2):
    """The real model (Q4_1 file, Q8_0 token table), 24 steps teacher-forced on the module path's greedy
    tokens, fused and module path side by side. Over 30 layers of 8-bit activation rounding a
    summation-order difference flips some codes by one step, so the logits are close, not equal:
    each step's max |difference| <= 10% of the logits' scale (seen: median 2.2%, max 2.9%), and the greedy token
    equal on >= 20 of 24 steps, any other step being a near-tie of the module path's (its top two
    closer than that step's difference)."""
    from tformer.interop.gguf_import import load_gguf

    model = load_gguf(smollm2[0], keep_quant=True)
    assert plan_of(model) is not None, whole.chosen(model).reason
    prompt = torch.tensor([[1, 504, 3458, 282, 4649, 314, 253, 1345, 2830, 30]])

    def logits_along(fused: bool, tokens: list[int] | None) -> list[torch.Tensor]:
        monkeypatch.setenv(whole.SWITCH, "1" if fused else "0")
        whole.choose(model)
        state, out = model.new_state(1, 40), []
        with torch.inference_mode():
            z = prefill(model, prompt, state)[0]
            for t in range(24):
                out.append(z)
                nxt = int(z.argmax()) if tokens is None else tokens[t]
                z = decode_step(model, torch.tensor([[nxt]]), state)[0]
        return out

    ref = logits_along(False, None)
    tokens = [int(z.argmax()) for z in ref]
    got = logits_along(True, tokens)
    same = 0
    for a, b in zip(got, ref):
        diff = float((a - b).abs().max())
        assert diff <= 0.1 * float(b.abs().max()), diff
        if int(a.argmax()) == int(b.argmax()):
            same += 1
        else:
            top = b.topk(2).values
            assert float(top[0] - top[1]) < diff
    assert same >= 20, same


@needs_tiles
def test_hooks_set_after_the_plan_take_the_module_path():
    """The plan is cached per model, but hooks (tformer.interp) are set per call: a model whose plan
    was made without hooks must still visit its hook points when hooks are set later."""
    from tformer.interp.hooks import hooks_set

    model, (fused, plain) = pair("q8_0")
    tok = torch.tensor([[5], [6]])
    with torch.inference_mode():
        assert decode(model, tok, fused) is not None           # the plan exists now
    seen = []
    with torch.inference_mode():
        with hooks_set(model, [("blocks.0.hook_resid_pre", lambda t, name: seen.append(name))]):
            decode_step(model, tok, plain)
    assert seen == ["blocks.0.hook_resid_pre"]


# ------------------------------------------------------------------ several new tokens per row
# tformer.fused.forward: a prompt (prefill) or a speculative check (extend) in one call.
# Same tolerances as above; the reference is the module path (TFORMER_FUSED_DECODE=0) from a state
# the module path filled.

def module_path(monkeypatch, model, fn):
    monkeypatch.setenv(whole.SWITCH, "0")
    whole.choose(model)
    try:
        return fn()
    finally:
        monkeypatch.setenv(whole.SWITCH, "1")
        whole.choose(model)


def close(a, b, rel=2e-3):
    return float((a - b).abs().max()) <= rel * float(b.abs().max())


@needs_tiles
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
def test_extend_equals_module_path(fmt, monkeypatch):
    """Prompt (from position 0), then three speculative-style checks of 4 tokens and a truncation,
    two rows: logits after every new token, caches, length and valid as the module path leaves them."""
    from tformer.generation.step import extend

    model = set_precision(tiny(), fmt)
    ids = torch.tensor([[3, 17, 5, 42, 8, 11, 2], [9, 1, 30, 7, 7, 60, 4]])
    fused, plain = model.new_state(2, 40), model.new_state(2, 40)
    calls = []
    monkeypatch.setattr(whole, "route", lambda *a, _f=whole.route, **kw: calls.append(_f(*a, **kw)) or calls[-1])
    with torch.inference_mode():
        a = prefill(model, ids, fused)
        b = module_path(monkeypatch, model, lambda: prefill(model, ids, plain))
        assert calls[0] is not None and close(a, b), float((a - b).abs().max())
        for step in range(3):
            new = torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4]]) + step
            a = extend(model, new, fused)
            b = module_path(monkeypatch, model, lambda: extend(model, new, plain))
            assert a.shape == b.shape == (2, 4, 61) and close(a, b), float((a - b).abs().max())
            assert fused.length == plain.length and torch.equal(fused.valid, plain.valid)
            for s in (fused, plain):
                s.truncate(s.length - 2)                      # two drafts rejected
    assert sum(c is not None for c in calls) == 4 and len(calls) == 8   # every whole-layer route taken
    n = plain.length
    for s, t in zip(fused.layers, plain.layers):
        assert (s.k[:, :, :n] - t.k[:, :, :n]).abs().max() <= 1e-4 * t.k[:, :, :n].abs().max()
        assert (s.v[:, :, :n] - t.v[:, :, :n]).abs().max() <= 1e-4 * t.v[:, :, :n].abs().max()


@needs_tiles
def test_pool_prefill_and_verify_equal_module_path(monkeypatch):
    """The server's calls: a batched right-padded prefill into pool rows (twice: the second after a
    cached prefix, through the writer's start), a speculative verify of one row, the static decode."""
    from tformer.serve.pool import KVPool

    model = set_precision(tiny(), "q4_1")
    prompts = [[3, 17, 5, 42, 8, 11, 2, 9, 1, 30, 7, 7, 60, 4, 5, 6, 1, 2, 3], [9, 1, 30, 7], [3, 17, 5, 42, 8]]
    later = [prompts[0] + [8, 9, 10, 11], [3, 17, 5]]                 # shares the first's 16-token block

    def run():
        pool = KVPool(model, n_slots=4, max_len=48, prefix_cache_mb=1)
        first = pool.prefill([0, 2, 3], prompts)                     # (3, vocab)
        pool.release(0, prompts[0])                                  # its full block into the prefix cache
        second = pool.prefill([0, 1], later)                         # slot 0 starts after the cached block
        checked = pool.verify(1, [5, 6, 7, 8])                       # (4, vocab)
        pool.keep(1, len(later[1]) + 2)
        step = pool.decode(torch.tensor([4, 5, 0, 6]), need=30)
        return first, second, checked, step, pool

    seen = []

    def spy(model, state, B, T, _f=whole.route, **kw):
        out = _f(model, state, B, T, **kw)
        if not kw.get("step"):                                       # prompts and checks, not the decode step
            seen.append((type(state.layers[0]).__name__, state.length, out is not None))
        return out

    monkeypatch.setattr(whole, "route", spy)
    with torch.inference_mode():
        got = run()
        fused_calls, seen[:] = list(seen), []
        want = module_path(monkeypatch, model, run)
    # fused: the first prefill, the second's two groups (after 0 and after the cached 16), the verify
    assert fused_calls == [("RowWriter", 0, True), ("RowWriter", 0, True), ("RowWriter", 16, True),
                           ("StaticKVCache", 3, True)], fused_calls
    for a, b in zip(got[:4], want[:4]):
        assert a.shape == b.shape and close(a, b), float((a - b).abs().max())
    assert torch.equal(got[4].state.valid, want[4].state.valid)
    for s, t in zip(got[4].state.layers, want[4].state.layers):
        real = want[4].state.valid[:, None, :, None]
        assert ((s.k - t.k) * real).abs().max() <= 1e-4 * t.k.abs().max()


@needs_tiles
def test_forward_leaves_what_it_does_not_implement_to_the_module_path():
    model, (state, _) = pair("q8_0")
    too_long = torch.zeros(1, whole.MAX_TOKENS + 1, dtype=torch.long)
    with torch.inference_mode():
        assert forward(model, too_long, model.new_state(1, 2 * whole.MAX_TOKENS)) is None
        assert forward(model, torch.tensor([[1, 2]]), None) is None
        padded = model.new_state(2, 40)
        prefill(model, torch.tensor([[0, 3, 4], [5, 6, 7]]), padded, attention_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]))
        assert forward(model, torch.tensor([[1, 2], [3, 4]]), padded) is None   # held padding
        full = model.new_state(2, 8)
        prefill(model, torch.tensor([[1] * 7, [2] * 7]), full)
        assert forward(model, torch.tensor([[1, 2], [3, 4]]), full) is None     # past max_len
        assert full.length == 7


@needs_tiles
def test_smollm2_speculative_tokens_equal_plain_greedy(monkeypatch, smollm2):
    """The real model: prompt-lookup speculative decoding through the fused multi-token checks gives
    the tokens of plain greedy decoding through the module path."""
    from tformer.generation.speculative import generate_speculative
    from tformer.interop.gguf_import import load_gguf

    model = load_gguf(smollm2[0], keep_quant=True)
    # "The capital of France is Paris. The capital of France is" (ids of SmolLM2's tokenizer)
    prompt = torch.tensor([[504, 3575, 282, 4649, 314, 7042, 30, 378, 3575, 282, 4649, 314]])

    def plain() -> list[int]:
        state = model.new_state(1, 60)
        tok = prefill(model, prompt, state).argmax(-1, keepdim=True)
        out = [int(tok)]
        for _ in range(19):
            tok = decode_step(model, tok, state).argmax(-1, keepdim=True)
            out.append(int(tok))
        return out

    # against plain greedy through the same fused layers: a k+1-token check computes each row as the
    # one-token step does (next test), so the tokens must be equal even at near-ties. Against the
    # module path they need not be: over 30 layers a summation-order difference moves some 8-bit
    # activation codes by one step, which moves SmolLM2's logits by up to ~0.8 (of 17.7), more than the
    # 0.04 between this prompt's two best tokens.
    with torch.inference_mode():
        want = plain()
        got, stats = generate_speculative(model, prompt, 20, k=4)
    assert got == want
    assert stats.forwards < 20                               # some drafts were accepted


@needs_tiles
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("fmt", ["q8_0", "q4_1", "fp32", "bf16"])
def test_a_check_of_several_tokens_computes_each_as_the_one_token_step(fmt, shape):
    """Fused extend over T tokens against T fused decode steps from the same state: every row's
    products, norms and attention take the same arithmetic in the same order (the tile kernels give
    each row the one-row result bit for bit, the float loops pass each row on its own), so the caches
    are equal, not just close, and so are the logits of block models (their head is tiles too)."""
    from tformer.generation.step import extend

    model, (a, b) = pair(fmt, shape)
    new = torch.tensor([[5, 9, 2, 7], [1, 1, 4, 3]])
    with torch.inference_mode():
        checked = extend(model, new, a)                                            # (2, 4, vocab)
        stepped = torch.stack([decode_step(model, new[:, t:t + 1], b) for t in range(4)], dim=1)
    if fmt in ("q8_0", "q4_1"):
        assert torch.equal(checked, stepped), float((checked - stepped).abs().max())
    else:   # the float head is a module: torch's GEMM for 4 rows, the GEMV for one (summation order)
        assert close(checked.float(), stepped.float(), 1e-5), float((checked - stepped).abs().max())
    n = b.length
    for s, t in zip(a.layers, b.layers):
        assert torch.equal(s.k[:, :, :n], t.k[:, :, :n]) and torch.equal(s.v[:, :, :n], t.v[:, :, :n])


@needs_tiles
def test_hooks_send_prompts_and_checks_to_the_module_path():
    """As for the decode step: with hooks set (tformer.interp), prefill and extend visit the hook points."""
    from tformer.generation.step import extend
    from tformer.interp.hooks import hooks_set

    model, (state, _) = pair("q8_0")
    seen = []
    with torch.inference_mode():
        with hooks_set(model, [("blocks.1.hook_resid_post", lambda t, name: seen.append(t.shape[1]))]):
            prefill(model, torch.tensor([[1, 2, 3]]), model.new_state(1, 16))
            extend(model, torch.tensor([[4, 5], [6, 7]]), state)
    assert seen == [3, 2]


@needs_tiles
@pytest.mark.parametrize("path", sorted(qgemv.TILE_ROWS))
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("fmt, rel", [("bf16", 1e-2), ("fp16", 2e-3)])
def test_half_weights_against_float32_of_the_same_rounded_weights(fmt, rel, shape, path, monkeypatch):
    """bf16 / fp16 weights: the fused layer widens them in registers and keeps the residual stream in
    float32 (the module path of a bf16 model rounds it to bf16 after every op), so its reference is
    the float32 module path of the same model with every parameter rounded to that type and back.
    What still differs is the cache, held in the model's dtype: keys and values rounded to 8 (bf16)
    or 11 (fp16) significant bits, a relative error of 2^-9 / 2^-12 per element, which moves
    logits by ~1e-3 / ~1e-4 of their scale here; bounds 1e-2 and 2e-3 of the largest logit."""
    if path not in qgemv.paths():
        pytest.skip(f"this CPU does not run {path}")
    monkeypatch.setenv(qgemv.FORCED, path)          # the float loops' 8- and 16-lane versions
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[fmt]
    model = set_precision(SHAPES[shape](), fmt)
    ref = SHAPES[shape]()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.to(dtype).float())
    ids = torch.tensor([[3, 17, 5, 42, 8, 11, 2], [9, 1, 30, 7, 7, 60, 4]])
    fused, plain = model.new_state(2, 40), ref.new_state(2, 40)
    assert plan_of(model) is not None and fused.layers[0].k.dtype == dtype
    tok = torch.tensor([[5], [6]])
    with torch.inference_mode():
        prefill(model, ids, fused)
        module_path(monkeypatch, ref, lambda: prefill(ref, ids, plain))
        for _ in range(8):
            a = decode(model, tok, fused)
            b = module_path(monkeypatch, ref, lambda: decode_logits(ref, tok, plain))
            assert a is not None and a.dtype == dtype
            assert close(a.float(), b, rel), (fmt, float((a.float() - b).abs().max()), float(b.abs().max()))
            tok = b.argmax(-1, keepdim=True)


@needs_tiles
def test_float_weights_leave_prompts_to_the_module_path():
    """A float product passes its weights once per token (torch's GEMM does not), so calls of more
    than MAX_FLOAT_ROWS tokens go to the module path; block weights take up to MAX_TOKENS a row."""
    n = whole.MAX_FLOAT_ROWS
    for fmt, fused in (("fp32", False), ("q8_0", True)):
        model = set_precision(tiny_gpt2(), fmt)
        with torch.inference_mode():
            long = torch.arange(1, n + 2)[None]
            assert (forward(model, long, model.new_state(1, 40)) is not None) is fused
            assert forward(model, long[:, :n], model.new_state(1, 40)) is not None


@needs_tiles
@pytest.mark.parametrize("fmt", ["q8_0", "fp32"])
def test_long_padded_context(fmt):
    """A context of 200 keys (the tiny tests' others hold < 48), a static pool with row 0 left-padded by
    90: the softmax over many keys, most of one row masked, decodes as the module path does, to the
    module docstring's bound."""
    model = set_precision(tiny(context_length=320), fmt)
    torch.manual_seed(1)
    ids = torch.randint(0, 61, (2, 200))
    mask = torch.ones(2, 200, dtype=torch.long)
    mask[0, :90] = 0                                          # 90 padding keys
    fused, plain = (model.new_state(2, 320, static=True) for _ in range(2))
    tok = torch.tensor([[5], [6]])
    with torch.inference_mode():
        for s in (fused, plain):
            prefill(model, ids, s, attention_mask=mask)
        for _ in range(6):                                    # keys 200 .. 205
            at = fused.valid.sum(-1)
            a = decode(model, tok, fused, positions=at[:, None])
            b = decode_logits(model, tok, plain, positions=at[:, None])
            assert a is not None and close(a, b), float((a - b).abs().max())
            tok = b.argmax(-1, keepdim=True)


@needs_tiles
@pytest.mark.parametrize("path", sorted(qgemv.TILE_ROWS))
@pytest.mark.parametrize("activation", ["relu", "relu2", "gelu", "silu"])
@pytest.mark.parametrize("fmt", ["q8_0", "fp32"])
def test_every_plain_mlp_activation(fmt, activation, path, monkeypatch):
    """The plain MLP's other activations (tformer train's recipes: ReLU² for `fast`, exact GELU for
    `classic`), against the module path (F.relu, ReLU², F.gelu, F.silu), to the module docstring's bound."""
    if path not in qgemv.paths():
        pytest.skip(f"this CPU does not run {path}")
    monkeypatch.setenv(qgemv.FORCED, path)
    model = set_precision(tiny_gpt2(activation), fmt)
    assert plan_of(model) is not None, whole.chosen(model).reason
    ids = torch.tensor([[3, 17, 5, 42, 8, 11, 2], [9, 1, 30, 7, 7, 60, 4]])
    fused, plain = model.new_state(2, 40), model.new_state(2, 40)
    tok = torch.tensor([[5], [6]])
    with torch.inference_mode():
        for s in (fused, plain):
            module_path(monkeypatch, model, lambda: prefill(model, ids, s))
        for _ in range(6):
            a = decode(model, tok, fused)
            b = decode_logits(model, tok, plain)
            assert a is not None and close(a, b), (activation, float((a - b).abs().max()))
            tok = b.argmax(-1, keepdim=True)


@needs_tiles
def test_a_weight_laid_back_by_the_plan_still_trains_through_autograd(monkeypatch):
    """A float DecodeLinear that chose torch.mm on a stored transpose is laid back to (N, K) when the
    plan is made, often inside inference_mode; the module path must still run under autograd after
    (the server's attributions take gradients with respect to the input)."""
    monkeypatch.setenv(kernels.FORCED, "mm_t")                # the stored-transpose kernel, not measured
    model = set_precision(tiny_gpt2(), "fp32")
    lin = model.blocks[0].attn.qkv_proj
    assert lin.transposed
    with torch.inference_mode():
        assert plan_of(model) is not None
    assert not lin.transposed and lin.weight.shape == (lin.out_features, lin.in_features)
    x = model.tok_emb(torch.tensor([[1, 2, 3]])).detach().requires_grad_(True)
    model.blocks[0](x).sum().backward()              # no "inference tensors cannot be saved for backward"
    assert x.grad is not None and x.grad.abs().sum() > 0


@needs_tiles
def test_layers_is_layer_per_layer():
    """One call over every layer's lists equals one layer call per layer (same x and caches after),
    and lists that do not split evenly into layers are refused in one sentence."""
    model = set_precision(tiny(), "q8_0")
    plan = plan_of(model)
    assert plan is not None, whole.chosen(model).reason
    states = [model.new_state(1, 16) for _ in range(2)]
    torch.manual_seed(1)
    x0 = torch.randn(1, model.config.d_model)
    write = at = torch.tensor([0])
    cos, sin = plan.rotary()
    xs = [x0.clone(), x0.clone()]
    whole.run_layers(plan, xs[0], [(s.k, s.v) for s in states[0].layers], write, at, None, None)
    for (norms, mats, biases, fmts), s in zip(plan.layers, states[1].layers):
        torch.ops.tformer_fused.layer(xs[1], norms, plan.eps, mats, biases, fmts, plan.dims, s.k, s.v,
                                      write, at, None, None, cos, sin, plan.path_id)
    assert torch.equal(xs[0], xs[1]) and not torch.equal(xs[0], x0)
    for a, b in zip(states[0].layers, states[1].layers):
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
    norms, mats, biases, fmts = plan.flat
    k = [s.k for s in states[0].layers]
    with pytest.raises(RuntimeError, match="one k and v cache per layer"):
        torch.ops.tformer_fused.layers(xs[0], norms[:-1], plan.eps, mats, biases, fmts, plan.dims, k, k,
                                       write, at, None, None, cos, sin, plan.path_id)
