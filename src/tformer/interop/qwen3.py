"""Qwen3 <-> tformer: Llama plus an RMSNorm over each head's q and k.

    # diff with Llama: q_norm and k_norm (RMSNorm of head_dim with a gain, shared by the heads, eps
    # rms_norm_eps) on q and k before RoPE: config qk_norm=True, qk_norm_gain=True; no q/k/v biases
    # (Qwen2 has them); head_dim set apart from hidden_size / heads (128 at every size).

Everything else (names, layout, RoPE, sliding-window layers, tied head) is :mod:`tformer.interop.llama`'s.
"""

from __future__ import annotations

import dataclasses

from tformer.config import TransformerConfig
from tformer.interop import llama
from tformer.interop.loader import TensorSource, require

MODEL_TYPES = ("qwen3",)
PREFIX = llama.PREFIX
HAS_QK_NORM = True                    # hf.save_hf: this family expresses QK-norm (with gains)
QK_NORMS = [("attn.q_norm.weight", "self_attn.q_norm.weight"), ("attn.k_norm.weight", "self_attn.k_norm.weight")]


def config_from_hf(hf: dict) -> TransformerConfig:
    c = llama.config_from_hf({**hf, "attention_bias": hf.get("attention_bias", False)})
    return dataclasses.replace(c, qk_norm=True, qk_norm_gain=True)


def state_from_hf(src: TensorSource, c: TransformerConfig) -> dict:
    state = llama.state_from_hf(src, c)
    for i in range(c.n_layers):
        for ours, theirs in QK_NORMS:
            state[f"blocks.{i}.{ours}"] = src.take(f"layers.{i}.{theirs}")
    return state


def model_type_for(c: TransformerConfig) -> str | None:
    """``"qwen3"`` for a Llama-shaped decoder with QK-norm gains; else ``None``."""
    if c.qk_norm and c.qk_norm_gain and c.model == "decoder" and c.mixer == "attention" and c.positions == "rope" \
            and c.norm == "rmsnorm" and c.ffn == "swiglu":                # a GELU gate: Gemma 3's (gemma3.py)
        return "qwen3"
    return None


def check_exportable(c: TransformerConfig, model_type: str) -> None:
    require(c, model_type, mixer="attention", positions="rope", norm="rmsnorm", norm_placement="pre", ffn="swiglu",
            causal=True, embedding_norm=False, type_vocab_size=0, embedding_scale=False, bias=False, qkv_bias=False,
            qk_norm=True, qk_norm_gain=True)   # Qwen3's attention_bias would put a bias on o_proj as well


def config_to_hf(c: TransformerConfig, model_type: str) -> dict:
    hf = llama.config_to_hf(c, "qwen2")                         # Qwen3Config has Qwen2's window fields
    hf.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", attention_bias=False)
    return hf


def state_to_hf(state: dict, c: TransformerConfig) -> dict:
    out = llama.state_to_hf(state, c)
    for i in range(c.n_layers):
        for ours, theirs in QK_NORMS:
            out[f"{PREFIX}layers.{i}.{theirs}"] = state[f"blocks.{i}.{ours}"]
    return out
