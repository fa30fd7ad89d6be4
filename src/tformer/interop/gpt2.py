"""GPT-2 <-> tformer: learned positions, pre-norm LayerNorm, tanh-GELU, tied head.

GPT-2 stores its projections as ``Conv1D`` with weights ``(in, out)``, the transpose of
``nn.Linear``; ``c_attn`` is already [W_Q; W_K; W_V] with heads contiguous, like tformer's qkv_proj.
"""

from __future__ import annotations

from tformer.config import TransformerConfig
from tformer.interop.loader import TensorSource, refuse, require

MODEL_TYPES = ("gpt2",)
PREFIX = "transformer."

HAS_RELU2 = True          # transformers' ACT2FN["relu2"] is ReLU(x)², tformer's activation="relu2"
ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu",
               "relu": "relu", "silu": "silu", "swish": "silu", "relu2": "relu2"}

# tformer name (under blocks.{i}.) -> GPT-2 name (under h.{i}.), and whether it is a Conv1D weight.
LAYER = [
    ("attn_norm.weight", "ln_1.weight", False), ("attn_norm.bias", "ln_1.bias", False),
    ("attn.qkv_proj.weight", "attn.c_attn.weight", True), ("attn.qkv_proj.bias", "attn.c_attn.bias", False),
    ("attn.out_proj.weight", "attn.c_proj.weight", True), ("attn.out_proj.bias", "attn.c_proj.bias", False),
    ("ffn_norm.weight", "ln_2.weight", False), ("ffn_norm.bias", "ln_2.bias", False),
    ("ffn.up.weight", "mlp.c_fc.weight", True), ("ffn.up.bias", "mlp.c_fc.bias", False),
    ("ffn.down.weight", "mlp.c_proj.weight", True), ("ffn.down.bias", "mlp.c_proj.bias", False),
]
TOP = [("tok_emb.weight", "wte.weight"), ("pos_emb.weight", "wpe.weight"),
       ("final_norm.weight", "ln_f.weight"), ("final_norm.bias", "ln_f.bias")]


def config_from_hf(hf: dict) -> TransformerConfig:
    act = hf.get("activation_function", "gelu_new")
    if act not in ACTIVATIONS:
        raise refuse("activation_function", act, f"known activations are {', '.join(ACTIVATIONS)}.")
    if not hf.get("scale_attn_weights", True):
        raise refuse("scale_attn_weights", False, "tformer always scales scores by 1/sqrt(head_dim).")
    if hf.get("scale_attn_by_inverse_layer_idx", False):
        raise refuse("scale_attn_by_inverse_layer_idx", True, "tformer does not scale attention by layer index.")
    if hf.get("add_cross_attention", False):
        raise refuse("add_cross_attention", True, "only the decoder-only GPT-2 is supported.")
    d = hf["n_embd"]
    return TransformerConfig(
        vocab_size=hf["vocab_size"], context_length=hf["n_positions"], n_layers=hf["n_layer"],
        d_model=d, n_heads=hf["n_head"], d_ff=hf.get("n_inner") or 4 * d, positions="learned",
        norm="layernorm", norm_eps=hf.get("layer_norm_epsilon", 1e-5), norm_placement="pre",
        ffn="mlp", activation=ACTIVATIONS[act], bias=True,
        tie_embeddings=hf.get("tie_word_embeddings", True), causal=True, name="gpt2",
    )


def state_from_hf(src: TensorSource, c: TransformerConfig) -> dict:
    src.drop(*[f"h.{i}.attn.{b}" for i in range(c.n_layers) for b in ("bias", "masked_bias")])  # old mask buffers
    state = {ours: src.take(theirs) for ours, theirs in TOP}
    for i in range(c.n_layers):
        for ours, theirs, conv1d in LAYER:
            t = src.take(f"h.{i}.{theirs}")
            state[f"blocks.{i}.{ours}"] = t.t() if conv1d else t
    state["lm_head.weight"] = src.take_lm_head(state["tok_emb.weight"], c.tie_embeddings)
    return state


def config_to_hf(c: TransformerConfig, model_type: str) -> dict:
    act = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu", "silu": "silu", "relu2": "relu2"}[c.activation]
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": c.vocab_size,
        "n_positions": c.context_length, "n_embd": c.d_model, "n_layer": c.n_layers, "n_head": c.n_heads,
        "n_inner": c.d_ff, "activation_function": act, "layer_norm_epsilon": c.norm_eps,
        "tie_word_embeddings": c.tie_embeddings, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
    }


def model_type_for(c: TransformerConfig) -> str | None:
    """``"gpt2"`` for a decoder of softmax attention with learned positions (the family to export it as
    when the config names none), else ``None``."""
    return "gpt2" if c.model == "decoder" and c.mixer == "attention" and c.positions == "learned" else None


def check_exportable(c: TransformerConfig, model_type: str) -> None:
    """Refuse a tformer config GPT-2 cannot express, naming the field."""
    require(c, model_type, mixer="attention", positions="learned", norm="layernorm", norm_placement="pre", ffn="mlp", bias=True,
            qkv_bias=True, causal=True, embedding_norm=False, sliding_window=None, type_vocab_size=0,
            n_kv_heads=c.n_heads, head_dim=c.d_model // c.n_heads)


def state_to_hf(state: dict, c: TransformerConfig) -> dict:
    out = {PREFIX + theirs: state[ours] for ours, theirs in TOP}
    for i in range(c.n_layers):
        for ours, theirs, conv1d in LAYER:
            t = state[f"blocks.{i}.{ours}"]
            out[f"{PREFIX}h.{i}.{theirs}"] = t.t() if conv1d else t
    if not c.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    return out
