"""Phi-3 / Phi-3.5-mini <-> tformer: Llama with fused projections and LongRoPE.

    # diff with Llama: q, k and v stored as one qkv_proj ([W_Q; W_K; W_V], tformer's own qkv_proj layout,
    # copied as is); gate and up stored as one gate_up_proj ([W_gate; W_up], 2·d_ff rows: split at load,
    # joined at save); RoPE ``longrope`` (config rope_scaling, tformer.nn.rope_scaling) with
    # original_max_position_embeddings at the top of config.json (older files) or in the RoPE dict;
    # a sliding_window not below max_position_embeddings masks nothing (Phi-3.5-mini: 262,144 > 131,072)
    # and is read as none; no biases, no head_dim field (hidden_size / heads), untied head.

Everything else (norm and projection names, RoPE layout, refusals) is :mod:`tformer.interop.llama`'s.
"""

from __future__ import annotations

import dataclasses

import torch

from tformer.config import TransformerConfig
from tformer.interop import llama
from tformer.interop.loader import TensorSource, refuse

MODEL_TYPES = ("phi3",)
PREFIX = llama.PREFIX
FUSED_QKV = ("attn.qkv_proj.weight", "self_attn.qkv_proj.weight")
GATE_UP = "mlp.gate_up_proj.weight"
# PEFT adapts the fused modules: tformer's split adapters are written onto them (training/peft_fused.py)
PEFT_FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
              "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
LAYER = [(t, h) for t, h in llama.LAYER if t not in ("ffn.gate.weight", "ffn.up.weight")]


def config_from_hf(hf: dict) -> TransformerConfig:
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise refuse(key, hf[key], "Phi-3 has no biases; tformer's phi3 converter reads none.")
    params = llama.rope_parameters(hf)
    original = hf.get("original_max_position_embeddings")
    if params.get("rope_type") == "longrope" and original is not None:   # transformers prefers the top-level one
        hf = {**hf, "rope_parameters": {**params, "original_max_position_embeddings": original}, "rope_scaling": None}
    window = hf.get("sliding_window")
    if window is not None and window >= hf.get("max_position_embeddings", 4096):
        window = None                                                   # no query is ever that far from a key
    hf = {**hf, "model_type": "mistral", "sliding_window": window, "attention_bias": False, "mlp_bias": False}
    return dataclasses.replace(llama.config_from_hf(hf), name="phi3")


def state_from_hf(src: TensorSource, c: TransformerConfig) -> dict:
    state = {"tok_emb.weight": src.take("embed_tokens.weight"), "final_norm.weight": src.take("norm.weight")}
    for i in range(c.n_layers):
        hf, ours = f"layers.{i}.", f"blocks.{i}."
        state[ours + FUSED_QKV[0]] = src.take(hf + FUSED_QKV[1])
        gate_up = src.take(hf + GATE_UP)                                  # (2 d_ff, C), or its block rows
        state[ours + "ffn.gate.weight"], state[ours + "ffn.up.weight"] = gate_up.chunk(2)
        for t, h in LAYER:
            state[ours + t] = src.take(hf + h)
    state["lm_head.weight"] = src.take_lm_head(state["tok_emb.weight"], c.tie_embeddings)
    return state


def model_type_for(c: TransformerConfig) -> str | None:
    """Never claimed by shape: a Llama-shaped config exports as ``llama`` (which names LongRoPE too); a
    model read from a Phi-3 folder or file keeps ``phi3`` through its ``hf_model_type``."""
    return None


def check_exportable(c: TransformerConfig, model_type: str) -> None:
    llama.check_exportable(c, "phi3")                                     # Llama's switches, no biases (QK-norm: hf.check_plain)
    if c.head_dim * c.n_heads != c.d_model:
        raise refuse("head_dim", c.head_dim, f"Phi3Config has no head_dim field; it must be d_model / n_heads = "
                     f"{c.d_model // c.n_heads}.")


def config_to_hf(c: TransformerConfig, model_type: str) -> dict:
    hf = llama.config_to_hf(c, "mistral")                                 # Mistral's sliding_window field
    del hf["head_dim"]
    hf.update(architectures=["Phi3ForCausalLM"], model_type="phi3", attention_bias=False, resid_pdrop=0.0,
              embd_pdrop=0.0)
    for key, default in (("bos_token_id", 1), ("eos_token_id", 32000), ("pad_token_id", 32000)):
        hf[key] = default if default < c.vocab_size else None       # Phi3Config's defaults, where they are ids
    scaling = c.rope_scaling or {}
    if "original_max_position_embeddings" in scaling:
        hf["original_max_position_embeddings"] = scaling["original_max_position_embeddings"]
    return hf


def state_to_hf(state: dict, c: TransformerConfig) -> dict:
    out = {PREFIX + "embed_tokens.weight": state["tok_emb.weight"], PREFIX + "norm.weight": state["final_norm.weight"]}
    for i in range(c.n_layers):
        hf, ours = f"{PREFIX}layers.{i}.", f"blocks.{i}."
        out[hf + FUSED_QKV[1]] = state[ours + FUSED_QKV[0]]
        out[hf + GATE_UP] = torch.cat([state[ours + "ffn.gate.weight"], state[ours + "ffn.up.weight"]])
        for t, h in LAYER:
            out[hf + h] = state[ours + t]
    if not c.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    return out
