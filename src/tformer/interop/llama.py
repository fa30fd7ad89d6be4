"""Llama family (Llama, Mistral, Qwen2) <-> tformer: RoPE, GQA, RMSNorm, SwiGLU, untied head.

The three differ only in config: Qwen2 has biases on q/k/v (not on o or the MLP), Mistral a
sliding window. HF stores q, k and v separately; tformer fuses them as [W_Q; W_K; W_V]. HF's RoPE
is the rotate-half layout tformer uses, so q/k need no permutation. A scaled RoPE (Llama 3.1's
``llama3``, ``linear``, Qwen's ``yarn``) is read from ``rope_parameters`` (transformers 5) or
``rope_scaling`` (older) into ``config.rope_scaling`` with transformers' own keys, and written back as
``rope_parameters``.
"""

from __future__ import annotations

import torch

from tformer.config import ROPE_SCALINGS, TransformerConfig
from tformer.errors import ConfigError
from tformer.interop.loader import TensorSource, hf_get, refuse, require

MODEL_TYPES = ("llama", "mistral", "qwen2")
PREFIX = "model."
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}

# tformer name (under blocks.{i}.) -> HF name (under layers.{i}.)
LAYER = [
    ("attn_norm.weight", "input_layernorm.weight"),
    ("attn.out_proj.weight", "self_attn.o_proj.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("ffn.gate.weight", "mlp.gate_proj.weight"),
    ("ffn.up.weight", "mlp.up_proj.weight"),
    ("ffn.down.weight", "mlp.down_proj.weight"),
]
BIASES = [("attn.out_proj.bias", "self_attn.o_proj.bias"), ("ffn.gate.bias", "mlp.gate_proj.bias"),
          ("ffn.up.bias", "mlp.up_proj.bias"), ("ffn.down.bias", "mlp.down_proj.bias")]
QKV = ("q_proj", "k_proj", "v_proj")
ROPE_TYPES = ("default",) + tuple(t for t in ROPE_SCALINGS if t != "factors")
# the keys of those scalings, which HF's rope_parameters name as tformer's config does
HF_ROPE_KEYS = tuple(dict.fromkeys(k for t in ROPE_TYPES[1:] for k in sum(ROPE_SCALINGS[t], ())))


def rope_parameters(hf: dict) -> dict:
    """The RoPE dict of an HF config: ``rope_parameters`` (transformers >= 5) or ``rope_theta`` and
    ``rope_scaling`` (older; its type under ``type`` or ``rope_type``)."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    params.update(scaling, rope_type=scaling.get("rope_type", scaling.get("type", params.get("rope_type"))))
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    return params


def rope_theta(hf: dict) -> float:
    """RoPE base from ``rope_parameters`` (transformers >= 5) or ``rope_theta`` (older); refuses a
    partial rotation, which tformer does not implement."""
    params = rope_parameters(hf)
    factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if factor != 1.0:
        raise refuse("partial_rotary_factor", factor, "tformer rotates the whole head.")
    return float(params["rope_theta"])


def rope_scaling(hf: dict) -> dict | None:
    """tformer's ``rope_scaling`` (:data:`tformer.config.ROPE_SCALINGS`) from the HF RoPE dict: ``None``
    for ``default``; ``linear``, ``llama3`` and ``yarn`` keep transformers' keys; others are refused."""
    params = rope_parameters(hf)
    kind = params.get("rope_type") or params.get("type", "default")
    if kind == "default":
        return None
    if kind not in ROPE_SCALINGS or kind == "factors":
        source = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
        raise refuse(f"{source}.rope_type", kind, f"tformer implements {', '.join(ROPE_TYPES)} RoPE.")
    if kind == "yarn" and (params.get("mscale") or params.get("mscale_all_dim")):
        raise refuse("rope_parameters.mscale", params.get("mscale"), "YaRN's mscale (DeepSeek's) is not implemented.")
    out = {"rope_type": kind, **{k: params[k] for k in HF_ROPE_KEYS if params.get(k) is not None}}
    if kind == "yarn":
        out.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
    for k in ("beta_fast", "beta_slow", "factor", "low_freq_factor", "high_freq_factor"):
        if k in out:
            out[k] = float(out[k])
    return out


def rope_to_hf(c: TransformerConfig) -> dict:
    """The HF ``rope_parameters`` of a config (refusing tformer's ``factors``, which HF has no name for)."""
    scaling = dict(c.rope_scaling or {"rope_type": "default"})
    if scaling["rope_type"] == "factors":
        raise ConfigError("cannot export RoPE given as per-frequency factors (a GGUF file's rope_freqs.weight that is "
                          "not Llama 3.1's scaling) to HuggingFace; transformers has no such rope_type.")
    return {**scaling, "rope_theta": c.rope_base}


def sliding_window(hf: dict, model_type: str) -> int | None:
    if model_type == "mistral":
        return hf.get("sliding_window")
    if model_type in ("qwen2", "qwen3"):
        types = set(hf.get("layer_types") or [])
        if hf.get("use_sliding_window") and types != {"full_attention"}:
            if types == {"sliding_attention"}:
                return hf["sliding_window"]
            raise refuse("layer_types", hf.get("layer_types"),
                         "a mix of sliding-window and full-attention layers is not implemented.")
        return None
    return None  # Llama has no window


def config_from_hf(hf: dict) -> TransformerConfig:
    model_type = hf["model_type"]
    if hf.get("hidden_act", "silu") != "silu":
        raise refuse("hidden_act", hf["hidden_act"], "the Llama-family converter supports SwiGLU (silu) only.")
    if model_type == "qwen2":
        qkv_bias, bias = True, False
    else:
        qkv_bias = bool(hf.get("attention_bias", False))
        if bool(hf.get("mlp_bias", False)) != qkv_bias:
            raise refuse("mlp_bias", hf.get("mlp_bias"), "tformer needs mlp_bias == attention_bias.")
        bias = qkv_bias
    d, nh = hf["hidden_size"], hf["num_attention_heads"]
    return TransformerConfig(
        vocab_size=hf["vocab_size"], context_length=hf.get("max_position_embeddings", 2048),
        n_layers=hf["num_hidden_layers"], d_model=d, n_heads=nh,
        n_kv_heads=hf_get(hf, "num_key_value_heads", default=nh), head_dim=hf_get(hf, "head_dim", default=d // nh),
        d_ff=hf["intermediate_size"], positions="rope", rope_base=rope_theta(hf), rope_scaling=rope_scaling(hf), norm="rmsnorm",
        norm_eps=hf.get("rms_norm_eps", 1e-6), norm_placement="pre", ffn="swiglu", bias=bias, qkv_bias=qkv_bias,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), causal=True,
        sliding_window=sliding_window(hf, model_type), name=model_type,
    )


def state_from_hf(src: TensorSource, c: TransformerConfig, layer: list = LAYER) -> dict:
    """tformer's state from HF's; ``layer``: the per-layer (tformer, HF) names beside q, k, v (Gemma passes its own)."""
    src.drop(*[f"layers.{i}.self_attn.rotary_emb.inv_freq" for i in range(c.n_layers)])  # old buffers
    state = {"tok_emb.weight": src.take("embed_tokens.weight"), "final_norm.weight": src.take("norm.weight")}
    for i in range(c.n_layers):
        hf, ours = f"layers.{i}.", f"blocks.{i}."
        state[ours + "attn.qkv_proj.weight"] = torch.cat([src.take(f"{hf}self_attn.{p}.weight") for p in QKV])
        if c.qkv_bias:
            state[ours + "attn.qkv_proj.bias"] = torch.cat([src.take(f"{hf}self_attn.{p}.bias") for p in QKV])
        for t, h in layer + (BIASES if c.bias else []):
            state[ours + t] = src.take(hf + h)
    state["lm_head.weight"] = src.take_lm_head(state["tok_emb.weight"], c.tie_embeddings)
    return state


def config_to_hf(c: TransformerConfig, model_type: str) -> dict:
    hf = {
        "architectures": [ARCHITECTURES[model_type]], "model_type": model_type, "vocab_size": c.vocab_size,
        "hidden_size": c.d_model, "intermediate_size": c.d_ff, "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_kv_heads, "head_dim": c.head_dim,
        "max_position_embeddings": c.context_length, "hidden_act": "silu", "rms_norm_eps": c.norm_eps,
        "rope_parameters": rope_to_hf(c), "rope_theta": c.rope_base,
        "tie_word_embeddings": c.tie_embeddings, "attention_dropout": 0.0,
    }
    if model_type == "llama":
        hf.update(attention_bias=c.bias, mlp_bias=c.bias)
    elif model_type == "mistral":
        hf["sliding_window"] = c.sliding_window
    else:  # qwen2
        window = c.sliding_window is not None
        hf.update(use_sliding_window=window, sliding_window=c.sliding_window, max_window_layers=c.n_layers,
                  layer_types=[("sliding_attention" if window else "full_attention")] * c.n_layers)
    return hf


def model_type_for(c: TransformerConfig) -> str | None:
    """For a decoder of softmax attention with RoPE (other than GPT-NeoX's LayerNorm and plain MLP):
    ``"qwen2"`` (biases on q/k/v only), ``"mistral"`` (a sliding window) or ``"llama"``; else ``None``."""
    if c.model != "decoder" or c.mixer != "attention" or c.positions != "rope" or c.qk_norm_gain:
        return None                                      # QK-norm gains: Qwen3's (qwen3.py)
    if c.ffn == "geglu" or c.post_norms:
        return None                                      # Gemma's (gemma2.py, gemma3.py)
    if c.norm == "layernorm" and c.ffn == "mlp":
        return None                                      # GPT-NeoX's (gpt_neox.py)
    if c.qkv_bias and not c.bias:
        return "qwen2"
    return "mistral" if c.sliding_window is not None else "llama"


def check_exportable(c: TransformerConfig, model_type: str) -> None:
    """Refuse a tformer config this HF family cannot express, naming the field."""
    require(c, model_type, mixer="attention", positions="rope", norm="rmsnorm", norm_placement="pre", ffn="swiglu", causal=True,
            embedding_norm=False, type_vocab_size=0, embedding_scale=False)
    if model_type == "qwen2":
        require(c, model_type, bias=False, qkv_bias=True)
    elif model_type in ("mistral", "phi3"):                # no biases anywhere
        require(c, model_type, bias=False, qkv_bias=False)
    else:
        require(c, model_type, sliding_window=None, qkv_bias=c.bias)


def state_to_hf(state: dict, c: TransformerConfig, layer: list = LAYER) -> dict:
    """:func:`state_from_hf` reversed."""
    out = {PREFIX + "embed_tokens.weight": state["tok_emb.weight"], PREFIX + "norm.weight": state["final_norm.weight"]}
    q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    for i in range(c.n_layers):
        hf, ours = f"{PREFIX}layers.{i}.", f"blocks.{i}."
        for kind in ("weight", "bias") if c.qkv_bias else ("weight",):
            q, k, v = state[f"{ours}attn.qkv_proj.{kind}"].split([q_dim, kv_dim, kv_dim])
            for name, t in zip(QKV, (q, k, v)):
                out[f"{hf}self_attn.{name}.{kind}"] = t
        for t, h in layer + (BIASES if c.bias else []):
            out[hf + h] = state[ours + t]
    if not c.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    return out
