"""The whole-layer call on the families' layers (each at its published configuration cut to 2 layers, from a
GGUF written by the ``gguf`` package): Llama 3.2's llama3-scaled RoPE and Qwen2.5's YaRN (other tables, the
attention factor in them; Phi-3.5's LongRoPE in a state of 64 and of 4,200 positions, its short and long
set), Qwen3's QK-norm with gains and head_dim 128 ≠ d/heads; Gemma 2 and 3 (from the HF folder: a local and a global
layer) with their (1 + w) gains, GeGLU, score scale and soft-cap, post-norms, sliding windows in a state longer than the
window and Gemma 3's local RoPE base, the embeddings' sqrt(d) and Gemma 2's logit soft-cap. Reference: the module path
on the same model. Float weights (the call's float loops): they differ only in summation order, so logits
to 1e-4 of their scale. q8_0 blocks: as ``test_layers.py`` says, a float-order difference can move an
activation across an 8-bit code boundary, which at these widths and random weights moves logits by up to
~1.5e-2 of their scale (seen); 3e-2 asserted, and the first layer's keys and values (upstream of any flip)
to 1e-4. Float weights leave prompts to the module path: their decode steps are compared."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")
pytest.importorskip("transformers")

import tformer.fused as whole  # noqa: E402
from tformer.generation.step import decode_logits  # noqa: E402
from tformer.interop.gguf_import import load_gguf  # noqa: E402
from tformer.interop.hf import load_hf  # noqa: E402
from tformer.quant import qgemv  # noqa: E402
from tformer.quant.quantize import set_precision  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "interop"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "quant"))
import families as F  # noqa: E402
from quant_models import tiny_gemma  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.skipif(qgemv.path() not in qgemv.TILE_ROWS, reason="no SIMD tile path on this CPU")
@pytest.mark.parametrize("kind, tol", [("f32", 1e-4), ("q8_0", 3e-2)])
@pytest.mark.parametrize("family, max_len", [(f, 64) for f in F.PUBLISHED if f != "llama-3.1-8b"
                                             and not f.startswith("gemma")]    # Gemma: refused (test_families_gemma.py)
                         + [("phi-3.5-mini", 4200)])          # a state past 4,096: LongRoPE's long set in both paths
def test_family_layers_run_whole_and_equal_the_module_path(family, max_len, kind, tol, tmp_path):
    path = F.write_gguf(family, F.hf_model(family), tmp_path / f"{kind}.gguf", kind)
    model = load_gguf(path, keep_quant=True) if kind != "f32" else set_precision(load_gguf(path), "fp32")
    choice = whole.chosen(model)
    assert choice.plan is not None, choice.reason
    ids = torch.tensor([F.prompts()[2][:20]])
    fused, plain = model.new_state(1, max_len), model.new_state(1, max_len)
    with torch.inference_mode():
        r = whole.route(model, fused, *ids.shape)
        assert (r is None) == (kind == "f32")                   # float weights leave prompts to the module path
        if r is not None:
            whole.forward(model, ids, fused, r)
        else:
            model(ids, state=fused, last_only=True)
        model(ids, state=plain, last_only=True)
        tok = torch.tensor([[5]])
        for _ in range(8):
            r = whole.route(model, fused, 1, 1, step=True)
            assert r is not None
            a = whole.decode(model, tok, fused, r)
            b = decode_logits(model, tok, plain)
            assert (a - b).abs().max() <= tol * b.abs().max(), (family, float((a - b).abs().max()))
            tok = b.argmax(-1, keepdim=True)
    if model.rope.longrope is not None:                          # the state's set was the one in use
        assert model.rope.inv_freq is model.rope.longrope[1 if max_len > 4096 else 0]
    n = plain.length
    # with floats every layer's keys and values agree; with blocks the first layer's, up to an activation code
    # that the two paths' float sums round to either side (seen: 2.5e-4 of the largest key; a wrong RoPE set: ~1)
    near = 1e-4 if kind == "f32" else 1e-3
    for s, t in list(zip(fused.layers, plain.layers))[:len(plain.layers) if kind == "f32" else 1]:
        assert (s.k[:, :, :n] - t.k[:, :, :n]).abs().max() <= near * t.k[:, :, :n].abs().max()
        assert (s.v[:, :, :n] - t.v[:, :, :n]).abs().max() <= near * t.v[:, :, :n].abs().max()


def gemma_model(family: str, window: int | None, folder: Path, kind: str):
    """``family`` from its HF folder (2 layers: Gemma 2 local then global, Gemma 3's cut a local and a global
    one), the window cut to ``window`` where given (so a short state passes it), at ``kind``."""
    ref = F.hf_model(family)
    if window is not None:
        ref.config.sliding_window = window
    ref.save_pretrained(folder)
    model = set_precision(load_hf(folder), kind)
    assert any(b.attn.window for b in model.blocks) and not all(b.attn.window for b in model.blocks)
    return model


@pytest.mark.skipif(qgemv.path() not in qgemv.TILE_ROWS, reason="no SIMD tile path on this CPU")
@pytest.mark.parametrize("kind, tol", [("fp32", 1e-4), ("q8_0", 3e-2), ("q4_0", 3e-2)])
@pytest.mark.parametrize("family, window, n", [("gemma-2-2b", None, 72), ("gemma-2-2b", 40, 72),
                                               ("gemma-3-270m", None, 600), ("gemma-3-1b", None, 600)])
def test_gemma_layers_run_whole_and_equal_the_module_path(family, window, n, kind, tol, tmp_path):
    """A prompt of ``n - 16`` tokens through the module path into both states (longer than the window where
    it is 40 or 512), then 8 new tokens in one whole call and 8 decode steps against the module path's, and
    the last step against recomputing the whole sequence without a state."""
    model = gemma_model(family, window, tmp_path, kind)
    choice = whole.chosen(model)
    assert choice.plan is not None, choice.reason
    assert choice.plan.windows and (choice.plan.local_rope is not None) == family.startswith("gemma-3")
    ids = torch.randint(0, F.VOCAB - len(F.SPECIAL) - 1, (1, n), generator=torch.Generator().manual_seed(3))
    held = n - 16
    fused, plain = model.new_state(1, n), model.new_state(1, n)
    with torch.inference_mode():
        for s in (fused, plain):
            model(ids[:, :held], state=s, last_only=True)
        r = whole.route(model, fused, 1, 8)
        assert r is not None                                    # 8 rows: float weights too
        a = whole.forward(model, ids[:, held:held + 8], fused, r)
        b = model(ids[:, held:held + 8], state=plain)[0]
        assert (a - b).abs().max() <= tol * b.abs().max(), (family, float((a - b).abs().max()))
        for t in range(held + 8, n):
            r = whole.route(model, fused, 1, 1, step=True)
            assert r is not None
            a = whole.decode(model, ids[:, t:t + 1], fused, r)
            b = decode_logits(model, ids[:, t:t + 1], plain)
            assert (a - b).abs().max() <= tol * b.abs().max(), (family, t, float((a - b).abs().max()))
        full = model(ids)[0][:, -1]                             # recomputed, no state
    assert (a - full).abs().max() <= tol * full.abs().max(), (family, float((a - full).abs().max()))
    near = 1e-4 if kind == "fp32" else 1e-3
    for s, t in list(zip(fused.layers, plain.layers))[:len(plain.layers) if kind == "fp32" else 1]:
        assert (s.k - t.k).abs().max() <= near * t.k.abs().max()
        assert (s.v - t.v).abs().max() <= near * t.v.abs().max()


@pytest.mark.skipif(qgemv.path() not in qgemv.TILE_ROWS, reason="no SIMD tile path on this CPU")
def test_a_gemma_style_model_from_the_switches_runs_whole():
    """The switches as ``tformer train --set`` sets them, with a score scale other than 1/sqrt(head_dim) (the
    published Gemmas above have query_pre_attn_scalar = head_dim) and QK-norm beside the soft-cap: whole,
    and equal to the module path to 1e-4 of the logits' scale over a state past the window."""
    model = set_precision(tiny_gemma(), "fp32")
    choice = whole.chosen(model)
    assert choice.plan is not None and choice.plan.scale == 0.1, choice.reason
    ids = torch.randint(0, 96, (1, 30), generator=torch.Generator().manual_seed(1))
    state = model.new_state(1, 30)
    with torch.inference_mode():
        model(ids[:, :20], state=state, last_only=True)
        steps = []
        for t in range(20, 30):
            r = whole.route(model, state, 1, 1, step=True)
            assert r is not None
            steps.append(whole.decode(model, ids[:, t:t + 1], state, r)[0])
        full = model(ids)[0][0, 20:]                            # the module path, no state
    assert F.relative(torch.stack(steps), full) < 1e-4
