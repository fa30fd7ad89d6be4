"""SmolLM2's GGUF imported with ``keep_quant=True``: the file's Q4_1 / Q8_0 blocks run as they are stored.

- structure: every layer matrix is a BlockLinear over the file's bytes (row for row, after the RoPE
  un-permutation of q and k and the q | k | v join), the Q8_0 embedding is a BlockEmbedding and the
  tied LM head a BlockLinear over the same buffer; the model holds no float copy of them (float
  elements: the norms and the RoPE tables, < 1% of the weights);
- exactness of the import: each block matrix dequantised equals the float32 import's weight bit for bit
  (the float import is ``gguf.quants.dequantize`` of the same bytes, an independent reader);
- logits against the float32 import: the only difference is the activations' rounding to 8-bit blocks
  before every product, which SmolLM2 (large outlier activations, 30 layers) amplifies: seen max
  |Δ| 1.8 and mean 0.25 on logits of magnitude ~31 over 14 positions; asserted max <= 3, mean <= 0.4
  and >= 75% equal argmax (seen 89%);
- against llama.cpp on the same file (its own ggml kernels, the same quantised arithmetic except that
  it rounds the activation scales to fp16): tformer's block model must be closer to llama.cpp than
  the float import is (mean |Δ| seen 0.18 against 0.25), max <= 2 (seen 1.2). Skipped without llama_cpp.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("gguf", reason="the optional extra 'gguf' is not installed")

from tformer.interop.gguf_import import load_gguf  # noqa: E402
from tformer.interop.gguf_reader import GGUFFile  # noqa: E402
from tformer.interop.gguf_import import llama_rope_unpermute  # noqa: E402
from tformer.quant.block_embedding import BlockEmbedding  # noqa: E402
from tformer.quant.block_linear import BlockLinear  # noqa: E402

IDS = [1, 504, 3458, 282, 4649, 314, 253, 1345, 2830, 30, 1536, 2012, 359, 260]


@pytest.fixture(scope="module")
def models(smollm2):
    path, _ = smollm2
    return path, load_gguf(path, keep_quant=True), load_gguf(path)


def test_blocks_are_the_file_bytes_and_no_float_copy(models):
    path, q, _ = models
    f = GGUFFile(path)
    assert isinstance(q.tok_emb, BlockEmbedding) and q.tok_emb.fmt == "q8_0"
    assert isinstance(q.lm_head, BlockLinear) and q.lm_head.blocks.data_ptr() == q.tok_emb.blocks.data_ptr()
    layer = q.blocks[3]
    for m in (layer.attn.qkv_proj, layer.attn.out_proj, layer.ffn.gate, layer.ffn.up, layer.ffn.down):
        assert isinstance(m, BlockLinear) and m.fmt == "q4_1"
    assert torch.equal(layer.ffn.down.blocks, torch.from_numpy(np.array(f.blocks("blk.3.ffn_down.weight"))))
    qrows = llama_rope_unpermute(np.array(f.blocks("blk.3.attn_q.weight")), 9)
    assert torch.equal(layer.attn.qkv_proj.blocks[:576], torch.from_numpy(qrows))
    floats = sum(t.numel() for t in list(q.parameters()) + list(q.buffers()) if t.is_floating_point())
    assert floats < 1e-2 * 134e6                       # norms (35k) and the RoPE tables (1.05M)


def test_block_matrices_dequantise_to_the_float_import(models):
    _, q, f = models
    assert torch.equal(q.tok_emb.dequantized(), f.tok_emb.weight)
    for i in (0, 29):
        bq, bf = q.blocks[i], f.blocks[i]
        for name in ("attn.qkv_proj", "attn.out_proj", "ffn.gate", "ffn.up", "ffn.down"):
            assert torch.equal(bq.get_submodule(name).dequantized(), bf.get_submodule(name).weight), (i, name)


@pytest.fixture(scope="module")
def logits(models):
    _, q, f = models
    with torch.inference_mode():
        return q(torch.tensor([IDS]))[0][0], f(torch.tensor([IDS]))[0][0]


def test_logits_near_the_float_import(logits):
    ours, ref = logits
    d = (ours - ref).abs()
    assert ref.abs().max() > 10
    assert d.max() <= 3 and d.mean() <= 0.4, (d.max(), d.mean())
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.75


def test_logits_near_llama_cpp(models, logits):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (the `bench` extra) is not installed")
    from tformer.interop.llama_cpp import LlamaCpp

    path, _, _ = models
    cpp = LlamaCpp(path, n_ctx=64, threads=1, logits_all=True, f32_cache=True, repack=False)
    theirs = torch.from_numpy(cpp.logits(IDS))
    ours, ref = logits
    mine, floats = (ours - theirs).abs(), (ref - theirs).abs()
    assert mine.max() <= 2, mine.max()
    assert mine.mean() < floats.mean(), (mine.mean(), floats.mean())


def test_open_model_keeps_blocks_only_in_the_files_format(smollm2):
    from tformer.inference import open_model

    path, _ = smollm2
    kept = open_model(path, "q4_1").model                   # the file's format: its bytes
    assert torch.equal(kept.blocks[0].ffn.up.blocks, torch.from_numpy(np.array(GGUFFile(path).blocks("blk.0.ffn_up.weight"))))
    other = open_model(path, "q8_0").model                  # another format: re-quantised from the float import
    assert other.blocks[0].ffn.up.fmt == "q8_0" and isinstance(other.tok_emb, torch.nn.Embedding)
