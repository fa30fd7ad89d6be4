"""Gemma 3 (text: Gemma3ForCausalLM, model_type gemma3_text) <-> tformer: Gemma 2 plus QK-norm and a RoPE
base per layer kind.

    # diff with Llama: Gemma 2's (gemma2.py: sqrt(d) embeddings, (1 + w) norm gains, post-norms, tanh-GELU
    # gate, query_pre_attn_scalar), and
    # - q_norm / k_norm over each head, gains applied as (1 + w)         config qk_norm, qk_norm_gain
    # - no soft-caps in the published configs (honoured when present)
    # - five sliding-window layers to one global (layer_types; window 512 at 270M and 1B)
    # - RoPE base 10,000 on the sliding layers, rope_theta (1,000,000) on the global ones, a scaling
    #   (4B and up: linear) on the global ones only                     config rope_local_base, rope_base, rope_scaling

RoPE comes from transformers 5's ``rope_parameters`` (one dict per layer kind, ``full_attention`` and
``sliding_attention``) or the older ``rope_theta``, ``rope_local_base_freq`` and ``rope_scaling``.
"""

from __future__ import annotations

import dataclasses

from tformer.config import TransformerConfig
from tformer.interop import gemma2, llama, qwen3
from tformer.interop.loader import TensorSource, refuse, require

MODEL_TYPES = ("gemma3_text",)
PREFIX = llama.PREFIX
HAS_QK_NORM = True
HAS_LOGIT_SOFTCAP = True
HAS_GEMMA_SWITCHES = True
LOCAL_BASE = 10000.0                  # rope_local_base_freq's default in transformers' Gemma3TextConfig


def rope_kinds(hf: dict) -> tuple[dict, float]:
    """(an HF-style config of the global layers' RoPE for :func:`tformer.interop.llama.rope_scaling`,
    the local layers' base); the local layers' RoPE must be unscaled."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        local = dict(params.get("sliding_attention") or {})
        if local.get("rope_type", "default") != "default":
            raise refuse("rope_parameters.sliding_attention.rope_type", local["rope_type"],
                         "tformer scales the global layers' RoPE only, as published Gemma 3 does.")
        glob = dict(params.get("full_attention") or {})
        glob.setdefault("rope_theta", 1000000.0)
        return {"rope_parameters": glob}, float(local.get("rope_theta", LOCAL_BASE))
    glob = {"rope_theta": hf.get("rope_theta", 1000000.0), "rope_scaling": hf.get("rope_scaling")}
    return glob, float(hf.get("rope_local_base_freq", LOCAL_BASE))


def config_from_hf(hf: dict) -> TransformerConfig:
    glob, local = rope_kinds(hf)
    plain = {k: v for k, v in hf.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
    c = llama.config_from_hf({**plain, **glob, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False})
    fields = gemma2.gemma_fields(hf, hf.get("sliding_window_pattern", 6))        # Gemma 3: 5 local, 1 global
    return dataclasses.replace(c, **fields, qk_norm=True, qk_norm_gain=True,
                               rope_local_base=local if fields["sliding_window"] is not None else None)


def state_from_hf(src: TensorSource, c: TransformerConfig) -> dict:
    state = gemma2.state_from_hf(src, c)
    for i in range(c.n_layers):
        for ours, theirs in qwen3.QK_NORMS:
            state[f"blocks.{i}.{ours}"] = src.take(f"layers.{i}.{theirs}")
    return state


def model_type_for(c: TransformerConfig) -> str | None:
    """``"gemma3_text"`` for a Gemma-shaped decoder with QK-norm gains; else ``None``."""
    return "gemma3_text" if gemma2.is_gemma(c) and c.qk_norm and c.qk_norm_gain else None


def check_exportable(c: TransformerConfig, model_type: str) -> None:
    gemma2.check_gemma(c, model_type)
    require(c, model_type, qk_norm=True, qk_norm_gain=True)


def config_to_hf(c: TransformerConfig, model_type: str) -> dict:
    local = {"rope_type": "default", "rope_theta": c.rope_local_base or c.rope_base}
    return {**gemma2.gemma_to_hf(c, model_type, "Gemma3ForCausalLM"),
            "rope_parameters": {"full_attention": llama.rope_to_hf(c), "sliding_attention": local}}


def state_to_hf(state: dict, c: TransformerConfig) -> dict:
    out = gemma2.state_to_hf(state, c)
    for i in range(c.n_layers):
        for ours, theirs in qwen3.QK_NORMS:
            out[f"{PREFIX}layers.{i}.{theirs}"] = state[f"blocks.{i}.{ours}"]
    return out
