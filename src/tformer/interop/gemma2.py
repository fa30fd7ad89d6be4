"""Gemma 2 <-> tformer: Llama with Gemma's norms, scaled embeddings, GELU gate and soft-caps.

    # diff with Llama:
    # - embeddings times sqrt(hidden_size)                                config embedding_scale=True
    # - every RMSNorm multiplies by (1 + w), w stored (and zero at init)  config norm_unit_offset=True
    # - a norm after attention and after the MLP too (4 per block):
    #   post_attention_layernorm is the attention's *output* norm here,
    #   pre_feedforward_layernorm the MLP's input norm                    config post_norms=True
    # - gate * up with tanh-GELU (hidden_activation gelu_pytorch_tanh)    config ffn="geglu", activation="gelu_tanh"
    # - scores times query_pre_attn_scalar^-1/2, not head_dim^-1/2       config attn_scale
    # - attention scores soft-capped (attn_logit_softcapping, 50)         config attn_softcap
    # - the LM head's logits soft-capped (final_logit_softcapping, 30)    config logit_softcap
    # - sliding-window layers alternate with global ones (layer_types)    config sliding_window, window_layers
    # - head_dim apart from hidden_size / heads (256 beside 2304 / 8), tied head, no biases

q, k, v are stored apart and fused as Llama's; RoPE is Llama's rotate-half. :mod:`tformer.interop.gemma3`
builds on this module.
"""

from __future__ import annotations

import dataclasses

import torch

from tformer.config import TransformerConfig
from tformer.interop import llama
from tformer.interop.loader import TensorSource, hf_get, refuse, require

MODEL_TYPES = ("gemma2",)
PREFIX = llama.PREFIX
HAS_LOGIT_SOFTCAP = True              # hf.save_hf: this family expresses logit_softcap
HAS_GEMMA_SWITCHES = True             # ... and the switches above
ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}        # HF's names -> tformer's activation
LAYER = [
    ("attn_norm.weight", "input_layernorm.weight"),
    ("attn.out_proj.weight", "self_attn.o_proj.weight"),
    ("attn_post_norm.weight", "post_attention_layernorm.weight"),
    ("ffn_norm.weight", "pre_feedforward_layernorm.weight"),
    ("ffn_post_norm.weight", "post_feedforward_layernorm.weight"),
    ("ffn.gate.weight", "mlp.gate_proj.weight"),
    ("ffn.up.weight", "mlp.up_proj.weight"),
    ("ffn.down.weight", "mlp.down_proj.weight"),
]


def window_layers(hf: dict, default_pattern: int) -> list[bool]:
    """Which layers slide: ``layer_types``, else every ``default_pattern``-th layer global (the rest local)."""
    types = hf.get("layer_types")
    if types is None:
        return [(i + 1) % default_pattern != 0 for i in range(hf["num_hidden_layers"])]
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown or len(types) != hf["num_hidden_layers"]:
        raise refuse("layer_types", types, "it must name sliding_attention or full_attention for every layer.")
    return [t == "sliding_attention" for t in types]


def gemma_fields(hf: dict, default_pattern: int) -> dict:
    """The config fields every Gemma shares (the diff above), from an HF Gemma 2 or 3 config."""
    act = hf_get(hf, "hidden_activation", "hidden_act", default="gelu_pytorch_tanh")
    if act not in ACTIVATIONS:
        raise refuse("hidden_activation", act, f"the Gemma converter gates with {', '.join(ACTIVATIONS)}.")
    if hf.get("attention_bias") or hf.get("use_bidirectional_attention"):
        field = "attention_bias" if hf.get("attention_bias") else "use_bidirectional_attention"
        raise refuse(field, hf[field], "Gemma as published has neither; tformer implements that one.")
    layers = window_layers(hf, default_pattern)
    window = hf.get("sliding_window") if any(layers) else None
    return dict(ffn="geglu", activation=ACTIVATIONS[act], embedding_scale=True, norm_unit_offset=True, post_norms=True,
                attn_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
                attn_softcap=float(hf.get("attn_logit_softcapping") or 0.0),
                logit_softcap=float(hf.get("final_logit_softcapping") or 0.0),
                sliding_window=window, window_layers=layers if window is not None else None,
                tie_embeddings=bool(hf.get("tie_word_embeddings", True)))


def config_from_hf(hf: dict) -> TransformerConfig:
    c = llama.config_from_hf({**hf, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False})
    return dataclasses.replace(c, **gemma_fields(hf, 2))           # Gemma 2: local, global, local, ...


def state_from_hf(src: TensorSource, c: TransformerConfig) -> dict:
    state = {"tok_emb.weight": src.take("embed_tokens.weight"), "final_norm.weight": src.take("norm.weight")}
    for i in range(c.n_layers):
        hf, ours = f"layers.{i}.", f"blocks.{i}."
        state[ours + "attn.qkv_proj.weight"] = torch.cat([src.take(f"{hf}self_attn.{p}.weight") for p in llama.QKV])
        for t, h in LAYER:
            state[ours + t] = src.take(hf + h)
    state["lm_head.weight"] = src.take_lm_head(state["tok_emb.weight"], c.tie_embeddings)
    return state


def is_gemma(c: TransformerConfig) -> bool:
    """A decoder with Gemma's block (post-norms, (1 + w) gains, GELU gate); gemma2 vs gemma3 by QK-norm."""
    return c.model == "decoder" and c.mixer == "attention" and c.positions == "rope" and c.post_norms \
        and c.norm_unit_offset and c.ffn == "geglu"


def model_type_for(c: TransformerConfig) -> str | None:
    """``"gemma2"`` for a Gemma-shaped decoder without QK-norm; else ``None``."""
    return "gemma2" if is_gemma(c) and not c.qk_norm else None


def check_gemma(c: TransformerConfig, model_type: str) -> None:
    """Refuse what an HF Gemma cannot express, naming the field."""
    require(c, model_type, mixer="attention", positions="rope", norm="rmsnorm", norm_placement="pre", ffn="geglu",
            causal=True, embedding_norm=False, type_vocab_size=0, bias=False, qkv_bias=False, embedding_scale=True,
            norm_unit_offset=True, post_norms=True)


def check_exportable(c: TransformerConfig, model_type: str) -> None:
    check_gemma(c, model_type)
    require(c, model_type, qk_norm=False, rope_local_base=None, rope_scaling=None)


def gemma_to_hf(c: TransformerConfig, model_type: str, architecture: str) -> dict:
    """The fields every Gemma's HF config shares."""
    scalar = c.attn_scale ** -2 if c.attn_scale is not None else c.head_dim
    return {
        "architectures": [architecture], "model_type": model_type, "vocab_size": c.vocab_size,
        "hidden_size": c.d_model, "intermediate_size": c.d_ff, "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_kv_heads, "head_dim": c.head_dim,
        "max_position_embeddings": c.context_length, "rms_norm_eps": c.norm_eps,
        "hidden_activation": {v: k for k, v in ACTIVATIONS.items()}[c.activation],
        "query_pre_attn_scalar": round(scalar) if abs(scalar - round(scalar)) < 1e-9 else scalar,
        "attn_logit_softcapping": c.attn_softcap or None, "final_logit_softcapping": c.logit_softcap or None,
        "sliding_window": c.sliding_window,
        "layer_types": ["sliding_attention" if c.windowed(i) else "full_attention" for i in range(c.n_layers)],
        "tie_word_embeddings": c.tie_embeddings, "attention_bias": False, "attention_dropout": 0.0,
    }


def config_to_hf(c: TransformerConfig, model_type: str) -> dict:
    return {**gemma_to_hf(c, model_type, "Gemma2ForCausalLM"), "rope_parameters": llama.rope_to_hf(c),
            "rope_theta": c.rope_base}


def state_to_hf(state: dict, c: TransformerConfig) -> dict:
    out = {PREFIX + "embed_tokens.weight": state["tok_emb.weight"], PREFIX + "norm.weight": state["final_norm.weight"]}
    q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    for i in range(c.n_layers):
        hf, ours = f"{PREFIX}layers.{i}.", f"blocks.{i}."
        for name, t in zip(llama.QKV, state[f"{ours}attn.qkv_proj.weight"].split([q_dim, kv_dim, kv_dim])):
            out[f"{hf}self_attn.{name}.weight"] = t
        for t, h in LAYER:
            out[hf + h] = state[ours + t]
    if not c.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    return out
