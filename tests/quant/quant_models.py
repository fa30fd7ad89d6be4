"""Models the quantisation tests share."""

import torch

from tformer import DecoderLM, TransformerConfig


def tiny(context_length: int = 48, **config):
    """A random Llama-shaped decoder (RoPE, GQA, RMSNorm, SwiGLU), its head scaled up so the logits are
    spread like a trained model's (greedy choices that quantisation error can flip); ``config`` adds to
    or overrides its TransformerConfig (``qk_norm=True``, say)."""
    torch.manual_seed(0)
    c = TransformerConfig(**{**dict(vocab_size=61, context_length=context_length, n_layers=2, d_model=64, n_heads=4,
                                    n_kv_heads=2, positions="rope", norm="rmsnorm", ffn="swiglu", bias=False),
                             **config})
    model = DecoderLM(c).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    return model


def tiny_gpt2(activation: str = "gelu_tanh"):
    """A random GPT-2-shaped decoder (learned positions, LayerNorm and biases, tanh-GELU MLP, tied
    head), its head scaled up as :func:`tiny`'s; every bias and norm shift random, so a product or
    norm that dropped one would show."""
    torch.manual_seed(0)
    c = TransformerConfig(vocab_size=61, context_length=48, n_layers=2, d_model=64, n_heads=4,
                          positions="learned", norm="layernorm", activation=activation, bias=True)
    model = DecoderLM(c).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
            elif "norm" in name:
                p.normal_(1, 0.1)
        model.tok_emb.weight.mul_(4)                         # the tied head: logits spread like tiny()'s
    return model
