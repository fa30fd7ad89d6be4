"""BERT <-> tformer's :class:`~tformer.models.encoder.EncoderModel`: bidirectional, post-norm,
token + position + token-type embeddings followed by a LayerNorm, exact-erf GELU.

Optional parts follow the checkpoint: the masked-LM head (``cls.predictions.*``, tied to the word
embeddings) and the pooler (``pooler.dense``, tanh on the [CLS] state).
"""

from __future__ import annotations

import torch

from tformer.config import TransformerConfig
from tformer.errors import ConfigError
from tformer.interop.loader import TensorSource, refuse, require

MODEL_TYPES = ("bert",)
PREFIX = "bert."

ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu",
               "silu": "silu", "swish": "silu"}

LAYER = [
    ("attn.out_proj", "attention.output.dense"), ("attn_norm", "attention.output.LayerNorm"),
    ("ffn.up", "intermediate.dense"), ("ffn.down", "output.dense"), ("ffn_norm", "output.LayerNorm"),
]
TOP = [("tok_emb.weight", "embeddings.word_embeddings.weight"),
       ("pos_emb.weight", "embeddings.position_embeddings.weight"),
       ("type_emb.weight", "embeddings.token_type_embeddings.weight"),
       ("emb_norm.weight", "embeddings.LayerNorm.weight"), ("emb_norm.bias", "embeddings.LayerNorm.bias")]
MLM = [("mlm_head.dense.weight", "cls.predictions.transform.dense.weight"),
       ("mlm_head.dense.bias", "cls.predictions.transform.dense.bias"),
       ("mlm_head.norm.weight", "cls.predictions.transform.LayerNorm.weight"),
       ("mlm_head.norm.bias", "cls.predictions.transform.LayerNorm.bias"),
       ("mlm_head.bias", "cls.predictions.bias")]
POOLER = [("pooler.weight", "pooler.dense.weight"), ("pooler.bias", "pooler.dense.bias")]
QKV = ("query", "key", "value")


def layers_from_hf(src: TensorSource, c: TransformerConfig, fused=(("qkv_proj", QKV),)) -> dict:
    """Every encoder layer of a BERT-style checkpoint (``encoder.layer.i.``) in tformer's names
    (``blocks.i.``): each ``(key, names)`` of ``fused`` concatenates HF's ``attention.self.<name>``
    projections into ``attn.<key>`` (biases only when ``c.qkv_bias``), plus :data:`LAYER`."""
    state = {}
    for i in range(c.n_layers):
        hf, ours = f"encoder.layer.{i}.", f"blocks.{i}."
        for kind in ("weight", "bias") if c.qkv_bias else ("weight",):
            for key, names in fused:
                state[f"{ours}attn.{key}.{kind}"] = torch.cat([src.take(f"{hf}attention.self.{p}.{kind}")
                                                               for p in names])
        for kind in ("weight", "bias"):
            for t, h in LAYER:
                state[f"{ours}{t}.{kind}"] = src.take(f"{hf}{h}.{kind}")
    return state


def layers_to_hf(state: dict, c: TransformerConfig, prefix: str = "", fused=(("qkv_proj", QKV),)) -> dict:
    """The inverse of :func:`layers_from_hf`, under ``{prefix}encoder.layer.i.`` (a fused projection
    or bias the state lacks is skipped)."""
    out, q_dim = {}, c.n_heads * c.head_dim
    for i in range(c.n_layers):
        hf, ours = f"{prefix}encoder.layer.{i}.", f"blocks.{i}."
        for kind in ("weight", "bias"):
            for key, names in fused:
                if f"{ours}attn.{key}.{kind}" in state:
                    for name, t in zip(names, state[f"{ours}attn.{key}.{kind}"].split(q_dim)):
                        out[f"{hf}attention.self.{name}.{kind}"] = t
            for t, h in LAYER:
                out[f"{hf}{h}.{kind}"] = state[f"{ours}{t}.{kind}"]
    return out


def config_from_hf(hf: dict) -> TransformerConfig:
    act = hf.get("hidden_act", "gelu")
    if act not in ACTIVATIONS:
        raise refuse("hidden_act", act, f"known activations are {', '.join(ACTIVATIONS)}.")
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise refuse("position_embedding_type", hf["position_embedding_type"],
                     "only absolute (learned) positions are implemented.")
    for flag in ("is_decoder", "add_cross_attention"):
        if hf.get(flag, False):
            raise refuse(flag, True, "only the bidirectional encoder is supported.")
    return TransformerConfig(
        vocab_size=hf["vocab_size"], context_length=hf.get("max_position_embeddings", 512),
        n_layers=hf["num_hidden_layers"], d_model=hf["hidden_size"], n_heads=hf["num_attention_heads"],
        d_ff=hf["intermediate_size"], positions="learned", norm="layernorm", norm_eps=hf.get("layer_norm_eps", 1e-12),
        norm_placement="post", ffn="mlp", activation=ACTIVATIONS[act], bias=True, tie_embeddings=True,
        causal=False, embedding_norm=True, type_vocab_size=hf.get("type_vocab_size", 2), name="bert",
    )


def state_from_hf(src: TensorSource, c: TransformerConfig) -> dict:
    src.drop("embeddings.position_ids", "embeddings.token_type_ids")  # index buffers, no weights
    state = {ours: src.take(theirs) for ours, theirs in TOP}
    state.update(layers_from_hf(src, c))
    if src.has("cls.predictions.bias"):
        state.update({ours: src.take(theirs) for ours, theirs in MLM})
        state["mlm_head.embedding.weight"] = state["tok_emb.weight"]
        src.take_tied("cls.predictions.decoder.weight", state["tok_emb.weight"])
        src.take_tied("cls.predictions.decoder.bias", state["mlm_head.bias"])
    if src.has("pooler.dense.weight"):
        state.update({ours: src.take(theirs) for ours, theirs in POOLER})
    return state


def config_to_hf(c: TransformerConfig, model_type: str, *, mlm: bool = False) -> dict:
    act = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "silu": "silu"}[c.activation]
    return {
        "architectures": ["BertForMaskedLM" if mlm else "BertModel"], "model_type": "bert",
        "vocab_size": c.vocab_size, "hidden_size": c.d_model, "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads, "intermediate_size": c.d_ff, "hidden_act": act,
        "max_position_embeddings": c.context_length, "type_vocab_size": c.type_vocab_size,
        "layer_norm_eps": c.norm_eps, "position_embedding_type": "absolute", "tie_word_embeddings": True,
        "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "pad_token_id": 0,
    }


def model_type_for(c: TransformerConfig) -> str | None:
    """``"bert"`` for an encoder of softmax attention, else ``None``."""
    return "bert" if c.model == "encoder" and c.mixer == "attention" else None


def export_options(state: dict) -> dict:
    """What :func:`config_to_hf` reads from the weights: an MLM head makes it ``BertForMaskedLM``."""
    return {"mlm": "mlm_head.bias" in state}


def check_exportable(c: TransformerConfig, model_type: str) -> None:
    """Refuse a tformer config BERT cannot express, naming the field."""
    require(c, model_type, mixer="attention", positions="learned", norm="layernorm", norm_placement="post", ffn="mlp", bias=True,
            qkv_bias=True, causal=False, embedding_norm=True, sliding_window=None, n_kv_heads=c.n_heads,
            head_dim=c.d_model // c.n_heads)
    if c.type_vocab_size < 1:
        raise ConfigError("cannot export as bert: it needs type_vocab_size >= 1, the model has 0.")


def state_to_hf(state: dict, c: TransformerConfig) -> dict:
    mlm = "mlm_head.bias" in state
    p = PREFIX if mlm else ""  # BertForMaskedLM nests the encoder under bert.; BertModel does not
    out = {p + theirs: state[ours] for ours, theirs in TOP}
    out.update(layers_to_hf(state, c, p))
    if mlm:
        out.update({theirs: state[ours] for ours, theirs in MLM})
    if "pooler.weight" in state:  # with the MLM head too: BertForMaskedLM ignores it, load_hf reads it back
        out.update({p + theirs: state[ours] for ours, theirs in POOLER})
    return out
