"""TransformerLens on the same weights as a tformer model: the reference the interp tests compare to.

A random tformer model (GPT-2-shaped or Llama-shaped) is exported with tformer's own HF converter
(``save_hf``), read back by transformers, and wrapped by TransformerLens 4's ``TransformerBridge``
(``boot_transformers(..., hf_model=...)``) in compatibility mode without weight processing (no
LayerNorm folding, no centring), so its activations are the model's own and comparable one to one.
Offline: the bridge gets the HF model object and a word-level tokenizer saved to a local folder.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from tformer import DecoderLM, TransformerConfig  # noqa: E402
from tformer.interop.hf import save_hf  # noqa: E402

V = 100
FAMILIES = {
    "gpt2": dict(vocab_size=V, context_length=64, n_layers=2, n_heads=4, d_model=64, activation="gelu_tanh",
                 positions="learned", norm="layernorm", bias=True),
    "llama": dict(vocab_size=V, context_length=64, n_layers=2, n_heads=4, n_kv_heads=2, d_model=64, d_ff=96,
                  positions="rope", norm="rmsnorm", norm_eps=1e-6, ffn="swiglu", bias=False,
                  tie_embeddings=False, rope_base=10000.0),
}


def tformer_model(family: str, seed: int = 0) -> DecoderLM:
    """A random model of ``family`` with weights ~ N(0, 0.15) and gains ~ 1 + N(0, 0.2), so attention
    is far from uniform and an error in any piece shows at 1e-5."""
    torch.manual_seed(seed)
    model = DecoderLM(TransformerConfig(**FAMILIES[family])).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if p.dim() == 1 and "norm" in name and name.endswith("weight") else 0.15 * noise)
    return model


def word_tokenizer(folder: Path):
    """A word-level tokenizer ``t0 .. t{V-1}`` saved to ``folder`` and loaded back (the bridge
    reloads a tokenizer by its path, so it must live on disk)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(V)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="t1", eos_token="t1",
                                                unk_token="t0", pad_token="t1")
    fast.save_pretrained(folder)
    return transformers.AutoTokenizer.from_pretrained(folder)


def bridge(model: DecoderLM, folder: Path):
    """TransformerLens's view of ``model``: export, load with transformers (eager attention), boot."""
    import transformers
    from transformer_lens.model_bridge import TransformerBridge

    save_hf(model, folder / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder / "hf", attn_implementation="eager").eval()
    name = "gpt2" if model.config.positions == "learned" else "llama-tiny"
    tl = TransformerBridge.boot_transformers(name, hf_model=hf, tokenizer=word_tokenizer(folder / "tok"))
    tl.enable_compatibility_mode(no_processing=True)
    return tl
