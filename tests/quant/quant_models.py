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


def tiny_gemma():
    """A random Gemma-style decoder from tformer's switches (3 layers: local, global, local with a window of 8,
    each kind its RoPE base; (1 + w) gains, GeGLU, post-norms, QK-norm, sqrt(d) embeddings, a score scale other
    than 1/sqrt(head_dim), attention and logit soft-caps), every weight N(0, 0.3) so the gains are far from 1."""
    torch.manual_seed(0)
    c = TransformerConfig(vocab_size=96, context_length=64, n_layers=3, d_model=64, n_heads=4, n_kv_heads=2,
                          head_dim=32, positions="rope", norm="rmsnorm", ffn="geglu", activation="gelu_tanh", bias=False,
                          embedding_scale=True, norm_unit_offset=True, post_norms=True, attn_scale=0.1,
                          attn_softcap=5.0, logit_softcap=3.0, sliding_window=8, window_layers=[True, False, True],
                          rope_base=1e6, rope_local_base=1e4, qk_norm=True, qk_norm_gain=True)
    model = DecoderLM(c).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
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
