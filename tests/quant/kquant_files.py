"""Random-weight Qwen2 models as GGUF files, quantised by llama.cpp's own quantiser (tests and benchmarks).

:func:`qwen2` builds a ``transformers`` Qwen2 model with random weights (norms and biases moved off their
initial values so they matter); :func:`write_gguf` writes it as llama.cpp's converter would (no Q/K
permutation for qwen2, matrices f16, norms and biases f32, ``tokenizer.ggml.model = "none"``: token ids in
and out); :func:`quantize` runs ``llama_cpp.llama_model_quantize`` on it (Q4_K_M, Q5_K_M, Q6_K, ...), the
file a user downloads, with llama.cpp's choice of type per tensor. ``QWEN25_05B`` is Qwen2.5-0.5B's
exact shape; its width (896) is no multiple of 256, so llama.cpp stores the matrices that read it in its
fallbacks (Q5_0, Q5_1, Q8_0) and only ``ffn_down`` (4864 = 19 · 256 inputs) in K-quants.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))     # tests/, for gguf_hf
from gguf_hf import add_llama_hyperparameters, finish  # noqa: E402

QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True)
SMOLLM2_360M = dict(vocab_size=49152, hidden_size=960, intermediate_size=2560, num_hidden_layers=32,
                    num_attention_heads=15, num_key_value_heads=5, tie_word_embeddings=True)
FTYPES = {"q4_k_m": 15, "q5_k_m": 17, "q6_k": 18, "q4_k_s": 14, "q8_0": 7, "q4_0": 2}   # llama_ftype numbers


def qwen2(seed: int = 0, **shape):
    """A random ``transformers`` Qwen2ForCausalLM (eval, float32) of ``shape`` (Qwen2Config's keys)."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(max_position_embeddings=4096, rms_norm_eps=1e-6, **shape)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.2)
    return model


def write_gguf(model, path: Path, encode=None) -> Path:
    """``model`` as a qwen2 GGUF: matrices f16, vectors f32, no tokenizer (ids only); ``encode(gguf name,
    float32 matrix)`` -> ``(bytes, GGMLQuantizationType)`` stores a matrix in another type instead."""
    import gguf

    c = model.config
    names = gguf.TensorNameMap(gguf.MODEL_ARCH.QWEN2, c.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), "qwen2")
    add_llama_hyperparameters(w, c)
    w.add_vocab_size(c.vocab_size)
    w.add_file_type(1)                                                # mostly f16
    w.add_tokenizer_model("none")
    for k, v in model.state_dict().items():
        if k == "lm_head.weight" and c.tie_word_embeddings:
            continue
        a, name = v.detach().numpy(), names.get_name(k, try_suffixes=(".weight", ".bias"))
        if encode is not None and a.ndim == 2:
            data, kind = encode(name, a.astype(np.float32))
            w.add_tensor(name, data, raw_dtype=kind)
        else:
            w.add_tensor(name, a.astype(np.float16 if a.ndim == 2 else np.float32))
    finish(w)
    return path


def quantize(src: Path, out: Path, kind: str, threads: int = 2, requantize: bool = False) -> Path:
    """``src`` quantised to ``kind`` (a key of :data:`FTYPES`) by llama.cpp's quantiser."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[kind]
    params.nthread = threads
    params.allow_requantize = requantize
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src}, {kind}) returned {rc}")
    return out
