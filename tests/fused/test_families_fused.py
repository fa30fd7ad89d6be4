"""The whole-layer call on the families' layers (each at its published configuration cut to 2 layers, from a
GGUF written by the ``gguf`` package): Llama 3.2's llama3-scaled RoPE and Qwen2.5's YaRN (other tables, the
attention factor in them), Qwen3's QK-norm with gains and head_dim 128 ≠ d/heads. Reference: the module path
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
from tformer.quant import qgemv  # noqa: E402
from tformer.quant.quantize import set_precision  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "interop"))
import families as F  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.skipif(qgemv.path() not in qgemv.TILE_ROWS, reason="no SIMD tile path on this CPU")
@pytest.mark.parametrize("kind, tol", [("f32", 1e-4), ("q8_0", 3e-2)])
@pytest.mark.parametrize("family", [f for f in F.PUBLISHED if f != "llama-3.1-8b"
                                    and not f.startswith("gemma")])    # Gemma: refused (test_families_gemma.py)
def test_family_layers_run_whole_and_equal_the_module_path(family, kind, tol, tmp_path):
    path = F.write_gguf(family, F.hf_model(family), tmp_path / f"{kind}.gguf", kind)
    model = load_gguf(path, keep_quant=True) if kind != "f32" else set_precision(load_gguf(path), "fp32")
    choice = whole.chosen(model)
    assert choice.plan is not None, choice.reason
    ids = torch.tensor([F.prompts()[2][:20]])
    fused, plain = model.new_state(1, 64), model.new_state(1, 64)
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
    n = plain.length
    # the first layer's keys and values see no flipped code upstream; with floats every layer's agree
    for s, t in list(zip(fused.layers, plain.layers))[:len(plain.layers) if kind == "f32" else 1]:
        assert (s.k[:, :, :n] - t.k[:, :, :n]).abs().max() <= 1e-4 * t.k[:, :, :n].abs().max()
        assert (s.v[:, :, :n] - t.v[:, :, :n]).abs().max() <= 1e-4 * t.v[:, :, :n].abs().max()
