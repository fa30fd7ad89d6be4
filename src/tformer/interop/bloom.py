"""BLOOM <-> tformer: ALiBi, a LayerNorm on the word embeddings, tanh-GELU, tied head.

BLOOM's fused ``query_key_value`` interleaves per head, rows ``[q_0, k_0, v_0, q_1, k_1, v_1, ...]``
(each ``head_dim`` rows); tformer's ``qkv_proj`` is ``[q_0 .. q_{h-1}; k_0 ..; v_0 ..]``, so the rows
are permuted both ways. BLOOM's ALiBi bias is ``slope_h * p_k``; tformer's ``-slope_h * (p_q - p_k)``
differs by a per-query constant, which softmax ignores, and the slopes follow the same recipe.
"""

from __future__ import annotations

import torch

from tformer.config import TransformerConfig
from tformer.interop.loader import TensorSource, hf_get, refuse, require

MODEL_TYPES = ("bloom",)
PREFIX = "transformer."

LAYER = [
    ("attn_norm", "input_layernorm"), ("attn.out_proj", "self_attention.dense"),
    ("ffn_norm", "post_attention_layernorm"), ("ffn.up", "mlp.dense_h_to_4h"), ("ffn.down", "mlp.dense_4h_to_h"),
]
TOP = [("tok_emb.weight", "word_embeddings.weight"),
       ("emb_norm.weight", "word_embeddings_layernorm.weight"), ("emb_norm.bias", "word_embeddings_layernorm.bias"),
       ("final_norm.weight", "ln_f.weight"), ("final_norm.bias", "ln_f.bias")]


def per_head_to_blocks(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    """BLOOM rows ``(nh, 3, hs, ...)`` -> tformer rows ``(3, nh, hs, ...)``, flattened back."""
    return t.reshape(n_heads, 3, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def blocks_to_per_head(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    """tformer rows ``(3, nh, hs, ...)`` -> BLOOM rows ``(nh, 3, hs, ...)``."""
    return t.reshape(3, n_heads, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def config_from_hf(hf: dict) -> TransformerConfig:
    if hf.get("apply_residual_connection_post_layernorm", False):
        raise refuse("apply_residual_connection_post_layernorm", True,
                     "tformer's pre-norm block adds the un-normalised residual.")
    d = hf_get(hf, "hidden_size", "n_embed")
    return TransformerConfig(
        vocab_size=hf["vocab_size"], context_length=hf.get("seq_length", 2048), n_layers=hf["n_layer"],
        d_model=d, n_heads=hf["n_head"], d_ff=4 * d, positions="alibi", norm="layernorm",
        norm_eps=hf.get("layer_norm_epsilon", 1e-5), norm_placement="pre", ffn="mlp", activation="gelu_tanh",
        bias=True, tie_embeddings=hf.get("tie_word_embeddings", True), causal=True, embedding_norm=True,
        name="bloom",
    )


def state_from_hf(src: TensorSource, c: TransformerConfig) -> dict:
    state = {ours: src.take(theirs) for ours, theirs in TOP}
    for i in range(c.n_layers):
        hf, ours = f"h.{i}.", f"blocks.{i}."
        for kind in ("weight", "bias"):
            qkv = src.take(f"{hf}self_attention.query_key_value.{kind}")
            state[f"{ours}attn.qkv_proj.{kind}"] = per_head_to_blocks(qkv, c.n_heads)
            for t, h in LAYER:
                state[f"{ours}{t}.{kind}"] = src.take(f"{hf}{h}.{kind}")
    state["lm_head.weight"] = src.take_lm_head(state["tok_emb.weight"], c.tie_embeddings)
    return state


def config_to_hf(c: TransformerConfig, model_type: str) -> dict:
    return {
        "architectures": ["BloomForCausalLM"], "model_type": "bloom", "vocab_size": c.vocab_size,
        "hidden_size": c.d_model, "n_layer": c.n_layers, "n_head": c.n_heads, "seq_length": c.context_length,
        "layer_norm_epsilon": c.norm_eps, "apply_residual_connection_post_layernorm": False,
        "tie_word_embeddings": c.tie_embeddings, "hidden_dropout": 0.0, "attention_dropout": 0.0,
    }


def model_type_for(c: TransformerConfig) -> str | None:
    """``"bloom"`` for a decoder of softmax attention with ALiBi, else ``None``."""
    return "bloom" if c.model == "decoder" and c.mixer == "attention" and c.positions == "alibi" else None


def check_exportable(c: TransformerConfig, model_type: str) -> None:
    """Refuse a tformer config BLOOM cannot express, naming the field."""
    require(c, model_type, mixer="attention", positions="alibi", norm="layernorm", norm_placement="pre", ffn="mlp",
            activation="gelu_tanh", bias=True, qkv_bias=True, causal=True, embedding_norm=True,
            sliding_window=None, type_vocab_size=0, n_kv_heads=c.n_heads, head_dim=c.d_model // c.n_heads,
            d_ff=4 * c.d_model)


def state_to_hf(state: dict, c: TransformerConfig) -> dict:
    out = {PREFIX + theirs: state[ours] for ours, theirs in TOP}
    for i in range(c.n_layers):
        hf, ours = f"{PREFIX}h.{i}.", f"blocks.{i}."
        for kind in ("weight", "bias"):
            qkv = state[f"{ours}attn.qkv_proj.{kind}"]
            out[f"{hf}self_attention.query_key_value.{kind}"] = blocks_to_per_head(qkv, c.n_heads)
            for t, h in LAYER:
                out[f"{hf}{h}.{kind}"] = state[f"{ours}{t}.{kind}"]
    if not c.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    return out
