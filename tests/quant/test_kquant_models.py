"""A GGUF quantised to Q4_K_M by llama.cpp, opened at ``--dtype auto``: every matrix kept in its own
format (Q4_K, Q6_K; q | k | v stacked where v differs), the whole-layer path over them, and the logits
against three independent references.

The file ``tests/data/qwen2-tiny-q4_k_m.gguf`` (see tests/data/README.md) is a random-weight Qwen2
(1 layer, d 256, 4/2 heads, ffn 256, vocabulary 256, tied head; q/k/v biases) that llama.cpp's own
quantiser made: ``attn_v``, ``ffn_down`` and the embedding are Q6_K, the rest Q4_K.

- the blocks are the file's bytes: each dequantised equals ``gguf.quants.dequantize`` (the float import)
  bit for bit, and no float copy is held;
- the whole-layer path against the module path (the same kernels; the C++ layer differs only in float
  summation order): logits within 2e-3 of their scale (tests/fused/test_layers.py's rule), seen ~1e-6;
- against the float import: only the activations' Q8_K rounding differs: max |Δ| <= 5% of the scale;
- against llama.cpp on the same file (the same Q8_K arithmetic): within 1e-4 of the scale (seen 4e-7).
  Skipped without llama_cpp; with it, Q5_K_M and Q6_K files quantised for the test are checked too.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import tformer.fused as whole
from tformer.generation.step import decode_step, prefill
from tformer.inference import open_model
from tformer.interop.gguf_import import load_gguf
from tformer.quant import qgemv
from tformer.quant.block_embedding import BlockEmbedding
from tformer.quant.block_linear import BlockLinear, StackedLinear

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kquant_files  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
FILE = Path(__file__).resolve().parents[1] / "data" / "qwen2-tiny-q4_k_m.gguf"
IDS = [3, 17, 5, 42, 8, 11, 2, 90, 200, 31, 64, 7, 129, 250]


@pytest.fixture(scope="module")
def opened():
    return open_model(FILE)


def test_auto_keeps_every_matrix_in_its_format(opened):
    m = opened.model
    assert opened.dtype == "q4_k+q6_k", opened.dtype_reason
    qkv = m.blocks[0].attn.qkv_proj
    assert isinstance(qkv, StackedLinear) and [p.fmt for p in qkv.parts] == ["q4_k", "q4_k", "q6_k"]
    assert [p.out_features for p in qkv.parts] == [256, 128, 128] and qkv.parts[0].bias is not None
    assert m.blocks[0].ffn.down.fmt == "q6_k" and m.blocks[0].ffn.gate.fmt == "q4_k"
    assert isinstance(m.tok_emb, BlockEmbedding) and m.tok_emb.fmt == "q6_k"
    assert isinstance(m.lm_head, BlockLinear) and m.lm_head.blocks.data_ptr() == m.tok_emb.blocks.data_ptr()
    named = list(m.named_parameters()) + list(m.named_buffers())
    floats = sum(t.numel() for n, t in named if t.is_floating_point() and "rope" not in n)
    weights = sum(t.numel() for _, t in named if t.dtype == torch.uint8)
    assert weights > 200_000 and floats < 0.01 * weights            # norms and biases only, no widened matrix
    if qgemv.path() in qgemv.TILE_ROWS:
        assert opened.path == "whole-layer", opened.path_reason


def test_blocks_dequantise_to_the_float_import(opened):
    f = load_gguf(FILE)
    q = opened.model
    assert torch.equal(q.tok_emb.dequantized(), f.tok_emb.weight)
    for name in ("attn.qkv_proj", "attn.out_proj", "ffn.gate", "ffn.up", "ffn.down"):
        assert torch.equal(q.blocks[0].get_submodule(name).dequantized(), f.blocks[0].get_submodule(name).weight), name


def _prompt_and_steps(model, fused: bool, monkeypatch, ids: list[int] = IDS, steps: int = 4) -> torch.Tensor:
    """Logits after the prompt and after each of ``steps`` greedy decode steps, ``(1 + steps, vocab)``."""
    monkeypatch.setenv(whole.plan.SWITCH, "1" if fused else "0")
    whole.choose(model)
    state = model.new_state(1, 64)
    out = []
    with torch.inference_mode():
        logits = prefill(model, torch.tensor([ids]), state)
        out.append(logits)                                    # (1, vocab): the last position
        tok = logits.argmax(-1, keepdim=True)
        for _ in range(steps):
            step = decode_step(model, tok, state)
            out.append(step)
            tok = step.argmax(-1, keepdim=True)
    monkeypatch.delenv(whole.plan.SWITCH)
    whole.choose(model)
    return torch.cat(out)


def test_whole_layer_path_equals_module_path(opened, monkeypatch):
    if qgemv.path() not in qgemv.TILE_ROWS:
        pytest.skip("no SIMD path on this CPU: no whole-layer call")
    a = _prompt_and_steps(opened.model, True, monkeypatch)
    b = _prompt_and_steps(opened.model, False, monkeypatch)
    assert a.shape == b.shape and b.abs().max() > 0.1
    assert float((a - b).abs().max()) <= 2e-3 * float(b.abs().max())


def test_logits_near_the_float_import(opened):
    f = load_gguf(FILE)
    with torch.inference_mode():
        ours = opened.model(torch.tensor([IDS]))[0][0]
        ref = f(torch.tensor([IDS]))[0][0]
    assert ref.abs().max() > 0.1
    assert float((ours - ref).abs().max()) <= 0.05 * float(ref.abs().max())


def _llama_cpp_logits(path: Path) -> np.ndarray:
    from tformer.interop.llama_cpp import LlamaCpp

    return LlamaCpp(path, n_ctx=64, threads=1, logits_all=True, f32_cache=True).logits(IDS)


def test_logits_equal_llama_cpp(opened):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (the `bench` extra) is not installed")
    want = torch.from_numpy(_llama_cpp_logits(FILE))
    with torch.inference_mode():
        got = opened.model(torch.tensor([IDS]))[0][0]
    assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max())


@pytest.mark.parametrize("kind", ["q5_k_m", "q6_k"])
def test_other_k_files_equal_llama_cpp(kind, tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (the `bench` extra) is not installed")
    model = kquant_files.qwen2(3, vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    path = kquant_files.quantize(kquant_files.write_gguf(model, tmp_path / "f16.gguf"), tmp_path / f"{kind}.gguf", kind)
    opened = open_model(path)
    assert opened.dtype in ("q5_k+q6_k", "q6_k"), opened.dtype
    want = torch.from_numpy(_llama_cpp_logits(path))
    with torch.inference_mode():
        got = opened.model(torch.tensor([IDS]))[0][0]
    assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max())


def _q5_model(qk_norm: bool = False):
    """quant_models.tiny with its products as Q5_0 / Q5_1 blocks quantised by gguf-py (``gguf.quants``, an
    independent quantiser): gate Q5_1, the rest Q5_0, and q | k | v stacked as Q5_0 | Q5_1 | Q5_0 so the
    layer call takes them apart. ``qk_norm``: Qwen3's QK-norm with gains too (random, q's and k's apart),
    so the call gets both optional entries of its dims (3 qkv parts, then QK-norm)."""
    import gguf

    from quant_models import tiny

    model = tiny(**(dict(qk_norm=True, qk_norm_gain=True) if qk_norm else {}))
    if qk_norm:
        with torch.no_grad():
            for b in model.blocks:
                b.attn.q_norm.weight.uniform_(0.2, 3)
                b.attn.k_norm.weight.uniform_(0.2, 3)
    kinds = {"q5_0": gguf.GGMLQuantizationType.Q5_0, "q5_1": gguf.GGMLQuantizationType.Q5_1}

    def blocks(weight, fmt):
        return BlockLinear(torch.from_numpy(gguf.quants.quantize(weight.detach().numpy(), kinds[fmt])), fmt)

    for b in model.blocks:
        q, k, v = b.attn.qkv_proj.weight.split([64, 32, 32])
        b.attn.qkv_proj = StackedLinear([blocks(q, "q5_0"), blocks(k, "q5_1"), blocks(v, "q5_0")])
        b.attn.out_proj = blocks(b.attn.out_proj.weight, "q5_0")
        b.ffn.gate, b.ffn.up, b.ffn.down = (blocks(b.ffn.gate.weight, "q5_1"), blocks(b.ffn.up.weight, "q5_0"),
                                            blocks(b.ffn.down.weight, "q5_0"))
    return model


@pytest.mark.parametrize("qk_norm", [False, True])
def test_q5_layers_whole_equal_module_path(monkeypatch, qk_norm):
    """Q5_0 / Q5_1 products in the whole-layer call (q, k, v apart; with QK-norm gains too) against the
    module path's BlockLinears."""
    if qgemv.path() not in qgemv.TILE_ROWS:
        pytest.skip("no SIMD path on this CPU: no whole-layer call")
    model = _q5_model(qk_norm)
    plan = whole.choose(model).plan
    assert plan is not None, whole.chosen(model).reason
    assert plan.dims[5:] == [3, int(qk_norm)]                # (..., mlp, qkv parts, QK-norm: both once either is needed)
    ids = [i % 61 for i in IDS]                          # the tiny model's vocabulary
    a = _prompt_and_steps(model, True, monkeypatch, ids)
    b = _prompt_and_steps(model, False, monkeypatch, ids)
    assert b.abs().max() > 0.1
    assert float((a - b).abs().max()) <= 2e-3 * float(b.abs().max())


def test_a_tiled_qkv_beside_stacked_ones_is_split_at_its_tiles(monkeypatch):
    """A model whose layer 0 has q, k, v in different formats (StackedLinear) and layer 1 one tiled q8_0 qkv:
    the call takes q, k, v apart in every layer, layer 1's as views of whole tiles (plan._qkv_parts)."""
    if qgemv.path() not in qgemv.TILE_ROWS:
        pytest.skip("no SIMD path on this CPU: no whole-layer call")
    from tformer.quant import blocks

    model = _q5_model()
    attn = model.blocks[1].attn
    attn.qkv_proj = BlockLinear(blocks.quantize(attn.qkv_proj.dequantized(), "q8_0"), "q8_0")
    plan = whole.choose(model).plan
    assert plan is not None, whole.chosen(model).reason
    tiles = attn.qkv_proj._tiled[qgemv.path()]
    qkv1 = plan.layers[1][1][:3]                                       # layer 1's q, k, v: views of its tiles
    assert qkv1[0].data_ptr() == tiles.data_ptr() and sum(m.shape[0] for m in qkv1) == tiles.shape[0]
    ids = [i % 61 for i in IDS]
    a = _prompt_and_steps(model, True, monkeypatch, ids)
    b = _prompt_and_steps(model, False, monkeypatch, ids)
    assert b.abs().max() > 0.1
    assert float((a - b).abs().max()) <= 2e-3 * float(b.abs().max())
