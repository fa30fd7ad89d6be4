"""BigBird <-> tformer's encoder with ``mixer="bigbird"``: a BERT-style post-norm encoder with
block-sparse attention (``attention_type="block_sparse"``) or full attention (``"original_full"``,
converted to ``mixer="attention"``).

``block_size`` and ``num_random_blocks`` carry over. ``transformers`` draws no random blocks in eval
mode (every random slot is block 0), so the converted model uses ``random="first"`` and equals HF's
eval-mode output; set ``random="seeded"`` to train with real random blocks. Sequences of
``<= (5 + 2r)·b`` tokens run dense in both, as HF does. The pooler (``pooler``, tanh on [CLS]) is
optional; task heads are refused.
"""

from __future__ import annotations


from tformer.config import TransformerConfig
from tformer.errors import ConfigError
from tformer.interop.bert import ACTIVATIONS, TOP, layers_from_hf, layers_to_hf
from tformer.interop.loader import TensorSource, refuse, require

MODEL_TYPES = ("big_bird",)
PREFIX = "bert."

POOLER = [("pooler.weight", "pooler.weight"), ("pooler.bias", "pooler.bias")]


def config_from_hf(hf: dict) -> TransformerConfig:
    act = hf.get("hidden_act", "gelu_new")
    if act not in ACTIVATIONS:
        raise refuse("hidden_act", act, f"known activations are {', '.join(ACTIVATIONS)}.")
    for flag in ("is_decoder", "add_cross_attention", "rescale_embeddings"):
        if hf.get(flag, False):
            raise refuse(flag, True, "only the plain bidirectional encoder is supported.")
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise refuse("position_embedding_type", hf["position_embedding_type"], "only absolute positions are implemented.")
    kind = hf.get("attention_type", "block_sparse")
    if kind not in ("block_sparse", "original_full"):
        raise refuse("attention_type", kind, "it must be block_sparse or original_full.")
    sparse = kind == "block_sparse"
    options = {"bigbird": {"block_size": hf.get("block_size", 64), "num_random_blocks": hf.get("num_random_blocks", 3),
                           "random": "first"}} if sparse else {}
    return TransformerConfig(
        vocab_size=hf["vocab_size"], context_length=hf.get("max_position_embeddings", 4096),
        n_layers=hf["num_hidden_layers"], d_model=hf["hidden_size"], n_heads=hf["num_attention_heads"],
        d_ff=hf["intermediate_size"], positions="learned", norm="layernorm", norm_eps=hf.get("layer_norm_eps", 1e-12),
        norm_placement="post", ffn="mlp", activation=ACTIVATIONS[act], bias=True, qkv_bias=hf.get("use_bias", True),
        tie_embeddings=True, causal=False, embedding_norm=True, type_vocab_size=hf.get("type_vocab_size", 2),
        name="big_bird", mixer="bigbird" if sparse else "attention", mixer_options=options,
    )


def state_from_hf(src: TensorSource, c: TransformerConfig) -> dict:
    src.drop("embeddings.position_ids", "embeddings.token_type_ids")
    state = {ours: src.take(theirs) for ours, theirs in TOP}
    state.update(layers_from_hf(src, c))
    if src.has("pooler.weight"):
        state.update({ours: src.take(theirs) for ours, theirs in POOLER})
    return state


def config_to_hf(c: TransformerConfig, model_type: str) -> dict:
    act = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "silu": "silu"}[c.activation]
    sparse = c.mixer == "bigbird"
    return {
        "architectures": ["BigBirdModel"], "model_type": "big_bird", "vocab_size": c.vocab_size,
        "hidden_size": c.d_model, "num_hidden_layers": c.n_layers, "num_attention_heads": c.n_heads,
        "intermediate_size": c.d_ff, "hidden_act": act, "max_position_embeddings": c.context_length,
        "type_vocab_size": c.type_vocab_size, "layer_norm_eps": c.norm_eps, "use_bias": c.qkv_bias,
        "attention_type": "block_sparse" if sparse else "original_full",
        "block_size": c.mixer_option("bigbird", "block_size", 64),
        "num_random_blocks": c.mixer_option("bigbird", "num_random_blocks", 3),
        "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "rescale_embeddings": False,
        "pad_token_id": 0,
    }


def model_type_for(c: TransformerConfig) -> str | None:
    """``"big_bird"`` for an encoder of BigBird layers, else ``None`` (an encoder of softmax attention
    exports as ``bert`` unless the config names ``big_bird``)."""
    return "big_bird" if c.model == "encoder" and c.mixer == "bigbird" else None


def check_exportable(c: TransformerConfig, model_type: str) -> None:
    """Refuse what BigBird cannot express, naming the field."""
    if c.mixer not in ("bigbird", "attention"):
        raise ConfigError(f"cannot export as big_bird: it needs mixer='bigbird' or 'attention', the model has "
                         f"mixer={c.mixer!r}.")
    require(c, model_type, positions="learned", norm="layernorm", norm_placement="post", ffn="mlp", bias=True,
            causal=False, embedding_norm=True, sliding_window=None, n_kv_heads=c.n_heads,
            head_dim=c.d_model // c.n_heads)


def state_to_hf(state: dict, c: TransformerConfig) -> dict:
    out = {theirs: state[ours] for ours, theirs in TOP}
    out.update(layers_to_hf(state, c))
    if "pooler.weight" in state:
        out.update({theirs: state[ours] for ours, theirs in POOLER})
    return out
