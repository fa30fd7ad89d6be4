"""Models the quantisation tests share."""

import torch

from tformer import DecoderLM, TransformerConfig


def tiny():
    """A random Llama-shaped decoder (RoPE, GQA, RMSNorm, SwiGLU), its head scaled up so the logits are
    spread like a trained model's (greedy choices that quantisation error can flip)."""
    torch.manual_seed(0)
    c = TransformerConfig(vocab_size=61, context_length=48, n_layers=2, d_model=64, n_heads=4,
                          n_kv_heads=2, positions="rope", norm="rmsnorm", ffn="swiglu", bias=False)
    model = DecoderLM(c).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    return model
