"""llama.cpp's own logits on the f32 GGUF that tformer exports equal tformer's (GPT-2 and Llama layouts).

An independent reader of the exporter: llama.cpp (through llama-cpp-python, the `bench` extra) runs
the file with its own kernels, RoPE and attention. Tolerance: 1e-3 on logits of magnitude ~10 (two
float32 implementations summing in different orders differ by ~1e-5 here); greedy tokens must match
over 12 steps. CI does not install llama-cpp-python, so there this module is skipped and the
exporter is checked by tests/interop/test_gguf.py (gguf's reader, tensor by tensor).
"""

import numpy as np
import pytest
import torch

pytest.importorskip("gguf", reason="the optional extra 'gguf' is not installed")
pytest.importorskip("llama_cpp", reason="llama-cpp-python (the `bench` extra) is not installed")

from tformer import DecoderLM, TransformerConfig  # noqa: E402
from tformer.generation.generate import generate  # noqa: E402
from tformer.interop.llama_cpp import LlamaCpp, build_info, export  # noqa: E402

LAYOUTS = {
    "gpt2": dict(vocab_size=96, context_length=64, n_layers=2, n_heads=4, d_model=64, activation="gelu_tanh",
                 positions="learned", norm="layernorm", bias=True),
    "llama": dict(vocab_size=96, context_length=64, n_layers=2, n_heads=4, n_kv_heads=2, d_model=64,
                  positions="rope", norm="rmsnorm", norm_eps=1e-6, ffn="swiglu", bias=False,
                  tie_embeddings=False, rope_base=10000.0),
}


def sharp_model(layout: str) -> DecoderLM:
    """A random model whose logits spread over several units, so greedy choices are not near-ties.

    Only the embedding / output matrices are scaled: ggml computes GELU through a float16 table
    (GGML_GELU_FP16 in ggml-cpu/vec.h), so large activations inside the MLP would measure that table,
    not the export; the LayerNorm / RMSNorm in front of every block keeps the blocks' inputs at their
    usual scale whatever the embedding's."""
    torch.manual_seed(0)
    model = DecoderLM(TransformerConfig(**LAYOUTS[layout])).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)          # the tied token table for GPT-2, the untied head for Llama
    return model


@pytest.mark.parametrize("layout", ["gpt2", "llama"])
def test_llama_cpp_logits_and_greedy_tokens_equal_tformer(layout, tmp_path):
    model = sharp_model(layout)
    path = export(model, tmp_path, ["f32"], model_type=layout)["f32"]
    prompt = torch.randint(0, 96, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(prompt)[0][0].numpy()                                   # (T, vocab)
    cpp = LlamaCpp(path, n_ctx=64, threads=1, logits_all=True, f32_cache=True)
    theirs = cpp.logits(prompt[0].tolist())
    assert theirs.shape == ours.shape
    assert np.abs(ours).max() > 3                                            # not a flat, uninformative check
    np.testing.assert_allclose(theirs, ours, atol=1e-3, rtol=0)
    greedy = generate(model, prompt, 12, temperature=0)[0, 10:].tolist()
    assert cpp.generate(prompt[0].tolist(), 12) == greedy


def test_build_info_names_the_version_the_folder_and_the_simd_features():
    import llama_cpp

    info = build_info()
    assert info.startswith(f"llama-cpp-python {llama_cpp.__version__} (")
    assert "built for: " in info and "AVX2 = " in info and "CPU :" not in info    # ggml's feature list, trimmed
