"""Longformer <-> tformer's encoder with ``mixer="longformer"``: a RoBERTa-style post-norm encoder whose
self-attention is a sliding window plus global tokens.

HF's ``attention_window`` (even, per layer) covers ``attention_window / 2`` keys on each side, which is
tformer's ``window = attention_window / 2 + 1`` (counting the token itself). HF takes the global
tokens as an input (``global_attention_mask``, default none); so does the converted model
(``global_inputs``: ``model(ids, global_attention_mask=...)``), and by default it has no global
token either, so it computes what ``LongformerModel`` computes when called the same way. A config
can also fix global tokens by position (``global_positions``, e.g. ``[0]`` for ``<s>`` as HF's
classification heads do; ``config_from_hf(hf, global_positions=[0])``). HF counts positions from
``pad_token_id + 1`` (RoBERTa); the converter keeps the table from that row on, so tformer's
position 0 is HF's first real position. The pooler is optional; task heads are refused.
"""

from __future__ import annotations

import torch

from tformer.config import TransformerConfig
from tformer.errors import ConfigError
from tformer.interop.bert import ACTIVATIONS, QKV, layers_from_hf, layers_to_hf
from tformer.interop.loader import TensorSource, refuse, require

MODEL_TYPES = ("longformer",)
PREFIX = "longformer."

TOP = [("tok_emb.weight", "embeddings.word_embeddings.weight"),
       ("type_emb.weight", "embeddings.token_type_embeddings.weight"),
       ("emb_norm.weight", "embeddings.LayerNorm.weight"), ("emb_norm.bias", "embeddings.LayerNorm.bias")]
POOLER = [("pooler.weight", "pooler.dense.weight"), ("pooler.bias", "pooler.dense.bias")]
GLOBAL = ("query_global", "key_global", "value_global")
FUSED = (("qkv_proj", QKV), ("global_qkv_proj", GLOBAL))


def _windows(hf: dict) -> list[int]:
    w = hf.get("attention_window", 512)
    windows = list(w) if isinstance(w, (list, tuple)) else [w] * hf["num_hidden_layers"]
    if len(windows) != hf["num_hidden_layers"] or any(x < 2 or x % 2 for x in windows):
        raise refuse("attention_window", w, "it must be an even number >= 2 (or one per layer).")
    return windows


def config_from_hf(hf: dict, global_positions: list[int] | None = None) -> TransformerConfig:
    act = hf.get("hidden_act", "gelu")
    if act not in ACTIVATIONS:
        raise refuse("hidden_act", act, f"known activations are {', '.join(ACTIVATIONS)}.")
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise refuse("position_embedding_type", hf["position_embedding_type"], "only absolute positions are implemented.")
    offset = hf.get("pad_token_id", 1) + 1
    return TransformerConfig(
        vocab_size=hf["vocab_size"], context_length=hf.get("max_position_embeddings", 4098) - offset,
        n_layers=hf["num_hidden_layers"], d_model=hf["hidden_size"], n_heads=hf["num_attention_heads"],
        d_ff=hf["intermediate_size"], positions="learned", norm="layernorm", norm_eps=hf.get("layer_norm_eps", 1e-12),
        norm_placement="post", ffn="mlp", activation=ACTIVATIONS[act], bias=True, tie_embeddings=True,
        causal=False, embedding_norm=True, type_vocab_size=hf.get("type_vocab_size", 2), name="longformer",
        mixer="longformer",
        mixer_options={"longformer": {"window": [w // 2 + 1 for w in _windows(hf)],
                                      "global_positions": list(global_positions or []), "global_inputs": True}},
    )


def state_from_hf(src: TensorSource, c: TransformerConfig) -> dict:
    src.drop("embeddings.position_ids", "embeddings.token_type_ids")
    state = {ours: src.take(theirs) for ours, theirs in TOP}
    table = src.take("embeddings.position_embeddings.weight")                # (max_positions, C)
    state["pos_emb.weight"] = table[table.shape[0] - c.context_length:]      # from pad_token_id + 1 on
    layers = layers_from_hf(src, c, FUSED)                                  # HF has global projections always,
    if not (c.mixer_option("longformer", "global_positions", [])            # tformer only when it can use them
            or c.mixer_option("longformer", "global_inputs", False)):
        layers = {k: v for k, v in layers.items() if ".attn.global_qkv_proj." not in k}
    state.update(layers)
    if src.has("pooler.dense.weight"):
        state.update({ours: src.take(theirs) for ours, theirs in POOLER})
    return state


def config_to_hf(c: TransformerConfig, model_type: str) -> dict:
    act = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "silu": "silu"}[c.activation]
    windows = c.mixer_option("longformer", "window", 256)
    windows = [windows[i % len(windows)] if isinstance(windows, list) else windows for i in range(c.n_layers)]
    return {
        "architectures": ["LongformerModel"], "model_type": "longformer", "vocab_size": c.vocab_size,
        "hidden_size": c.d_model, "num_hidden_layers": c.n_layers, "num_attention_heads": c.n_heads,
        "intermediate_size": c.d_ff, "hidden_act": act, "max_position_embeddings": c.context_length + 2,
        "type_vocab_size": c.type_vocab_size, "layer_norm_eps": c.norm_eps, "pad_token_id": 1,
        "attention_window": [2 * (w - 1) for w in windows], "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0, "position_embedding_type": "absolute",
    }


def model_type_for(c: TransformerConfig) -> str | None:
    """``"longformer"`` for an encoder of Longformer layers, else ``None``."""
    return "longformer" if c.model == "encoder" and c.mixer == "longformer" else None


def check_exportable(c: TransformerConfig, model_type: str) -> None:
    """Refuse what Longformer cannot express, naming the field."""
    require(c, model_type, mixer="longformer", positions="learned", norm="layernorm", norm_placement="post",
            ffn="mlp", bias=True, qkv_bias=True, causal=False, embedding_norm=True, n_kv_heads=c.n_heads,
            head_dim=c.d_model // c.n_heads)
    if c.mixer_option("longformer", "dilation", 1) != 1:
        raise ConfigError("cannot export as longformer: HF's Longformer has no dilation (it needs dilation=1).")
    if not (c.mixer_option("longformer", "global_positions", []) or c.mixer_option("longformer", "global_inputs",
                                                                                     False)):
        raise ConfigError("cannot export as longformer: HF's global projections exist for every model and this one "
                          "has none; build it with global_inputs=True (or global_positions).")


def state_to_hf(state: dict, c: TransformerConfig) -> dict:
    out = {theirs: state[ours] for ours, theirs in TOP}
    table = state["pos_emb.weight"]
    out["embeddings.position_embeddings.weight"] = torch.cat([table.new_zeros(2, table.shape[1]), table])
    out.update(layers_to_hf(state, c, fused=FUSED))
    if "pooler.weight" in state:
        out.update({theirs: state[ours] for ours, theirs in POOLER})
    return out
