"""GPT-NeoX <-> tformer: RoPE on the whole head, pre-norm LayerNorm, a plain MLP, sequential residuals.

The family that expresses the model of tformer's ``fast`` recipe (RoPE + LayerNorm + ReLU² MLP, tied
head), which GPT-2 (learned positions) and Llama (RMSNorm, SwiGLU) do not. Two layout differences:
NeoX's ``query_key_value`` output is grouped by head, ``[q_h; k_h; v_h]`` for each head ``h``, where
tformer's ``qkv_proj`` is ``[Q; K; V]`` with the heads inside each; and NeoX always has biases on the
norms and the MLP (and on attention unless ``attention_bias`` is false), so a tformer model without
biases exports zeros. Both apply RoPE in the rotate-half layout, so q and k need no permutation.
Only ``use_parallel_residual=false`` (x + attn, then + mlp, as in every tformer block) and
``partial_rotary_factor=1`` (the whole head rotated) are tformer's; other NeoX checkpoints are refused.
"""

from __future__ import annotations

import torch

from tformer.config import TransformerConfig
from tformer.interop.loader import TensorSource, refuse, require

MODEL_TYPES = ("gpt_neox",)
PREFIX = "gpt_neox."
HAS_RELU2 = True          # transformers' ACT2FN["relu2"] is ReLU(x)², tformer's activation="relu2"
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu",
               "silu": "silu", "swish": "silu", "relu2": "relu2"}
TO_HF_ACT = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "silu": "silu", "relu2": "relu2"}

# tformer name (under blocks.{i}.) -> NeoX name (under layers.{i}.); qkv_proj is regrouped by head
LAYER = [("attn_norm", "input_layernorm"), ("attn.out_proj", "attention.dense"),
         ("ffn_norm", "post_attention_layernorm"), ("ffn.up", "mlp.dense_h_to_4h"), ("ffn.down", "mlp.dense_4h_to_h")]
QKV = ("attn.qkv_proj", "attention.query_key_value")


def _rope(hf: dict) -> tuple[float, float]:
    """(base, rotated fraction of the head) from ``rope_parameters`` (transformers >= 5) or the older
    ``rotary_emb_base`` / ``rotary_pct``."""
    params = hf.get("rope_parameters") or {}
    if params.get("rope_type", "default") != "default" or hf.get("rope_scaling"):
        raise refuse("rope_parameters.rope_type", params.get("rope_type", hf.get("rope_scaling")),
                     "only unscaled RoPE ('default') is implemented.")
    base = params.get("rope_theta", hf.get("rotary_emb_base", hf.get("rope_theta", 10000.0)))
    return float(base), float(params.get("partial_rotary_factor", hf.get("rotary_pct", 0.25)))


def config_from_hf(hf: dict) -> TransformerConfig:
    act = hf.get("hidden_act", "gelu")
    if act not in ACTIVATIONS:
        raise refuse("hidden_act", act, f"known activations are {', '.join(ACTIVATIONS)}.")
    if hf.get("use_parallel_residual", True):
        raise refuse("use_parallel_residual", True, "tformer's blocks add attention and then the MLP in sequence.")
    base, fraction = _rope(hf)
    if fraction != 1.0:
        raise refuse("partial_rotary_factor", fraction, "tformer rotates the whole head.")
    if not hf.get("attention_bias", True):
        raise refuse("attention_bias", False, "tformer has biases everywhere or nowhere (NeoX's MLP always has them).")
    d = hf["hidden_size"]
    return TransformerConfig(
        vocab_size=hf["vocab_size"], context_length=hf.get("max_position_embeddings", 2048),
        n_layers=hf["num_hidden_layers"], d_model=d, n_heads=hf["num_attention_heads"], d_ff=hf["intermediate_size"],
        positions="rope", rope_base=base, norm="layernorm", norm_eps=hf.get("layer_norm_eps", 1e-5),
        norm_placement="pre", ffn="mlp", activation=ACTIVATIONS[act], bias=True,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), causal=True, name="gpt_neox",
    )


def _by_head(t: torch.Tensor, c: TransformerConfig) -> torch.Tensor:
    """tformer's ``[Q; K; V]`` rows (heads inside each) -> NeoX's ``[q_h; k_h; v_h]`` for each head."""
    return t.reshape(3, c.n_heads, c.head_dim, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def _by_kind(t: torch.Tensor, c: TransformerConfig) -> torch.Tensor:
    """The inverse of :func:`_by_head`."""
    return t.reshape(c.n_heads, 3, c.head_dim, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def state_from_hf(src: TensorSource, c: TransformerConfig) -> dict:
    src.drop(*[f"layers.{i}.attention.{b}" for i in range(c.n_layers)
               for b in ("bias", "masked_bias", "rotary_emb.inv_freq")])                 # old buffers
    state = {"tok_emb.weight": src.take("embed_in.weight"), "final_norm.weight": src.take("final_layer_norm.weight"),
             "final_norm.bias": src.take("final_layer_norm.bias")}
    for i in range(c.n_layers):
        hf, ours = f"layers.{i}.", f"blocks.{i}."
        for kind in ("weight", "bias"):
            state[f"{ours}{QKV[0]}.{kind}"] = _by_kind(src.take(f"{hf}{QKV[1]}.{kind}"), c)
            for t, h in LAYER:
                state[f"{ours}{t}.{kind}"] = src.take(f"{hf}{h}.{kind}")
    if not c.tie_embeddings and src.has("embed_out.weight"):      # the name before transformers 5
        state["lm_head.weight"] = src.take("embed_out.weight")
    else:
        state["lm_head.weight"] = src.take_lm_head(state["tok_emb.weight"], c.tie_embeddings)
    return state


def config_to_hf(c: TransformerConfig, model_type: str) -> dict:
    return {
        "architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "vocab_size": c.vocab_size,
        "hidden_size": c.d_model, "intermediate_size": c.d_ff, "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads, "max_position_embeddings": c.context_length,
        "hidden_act": TO_HF_ACT[c.activation], "layer_norm_eps": c.norm_eps, "use_parallel_residual": False,
        "attention_bias": True, "tie_word_embeddings": c.tie_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_base, "partial_rotary_factor": 1.0},
        "rotary_emb_base": c.rope_base, "rotary_pct": 1.0,                                  # transformers < 5
        "attention_dropout": 0.0, "hidden_dropout": 0.0,
    }


def model_type_for(c: TransformerConfig) -> str | None:
    """``"gpt_neox"`` for a decoder of softmax attention with RoPE, LayerNorm and a plain MLP (the fast
    recipe's model), else ``None``."""
    fits = c.model == "decoder" and c.mixer == "attention" and c.positions == "rope"
    return "gpt_neox" if fits and c.norm == "layernorm" and c.ffn == "mlp" else None


def check_exportable(c: TransformerConfig, model_type: str) -> None:
    """Refuse a tformer config GPT-NeoX cannot express, naming the field."""
    require(c, model_type, mixer="attention", positions="rope", norm="layernorm", norm_placement="pre", ffn="mlp",
            causal=True, embedding_norm=False, sliding_window=None, type_vocab_size=0, n_kv_heads=c.n_heads,
            head_dim=c.d_model // c.n_heads)


def state_to_hf(state: dict, c: TransformerConfig) -> dict:
    """NeoX's tensors; a bias tformer's model does not have is written as zeros (the same function)."""
    def get(name: str, like: str) -> torch.Tensor:
        if name in state:
            return state[name]
        weight = state[like]
        return weight.new_zeros(weight.shape[0] if weight.dim() == 2 else weight.shape)

    out = {PREFIX + "embed_in.weight": state["tok_emb.weight"],
           PREFIX + "final_layer_norm.weight": state["final_norm.weight"],
           PREFIX + "final_layer_norm.bias": get("final_norm.bias", "final_norm.weight")}
    for i in range(c.n_layers):
        hf, ours = f"{PREFIX}layers.{i}.", f"blocks.{i}."
        weight = state[f"{ours}{QKV[0]}.weight"]
        out[f"{hf}{QKV[1]}.weight"] = _by_head(weight, c)
        out[f"{hf}{QKV[1]}.bias"] = _by_head(get(f"{ours}{QKV[0]}.bias", f"{ours}{QKV[0]}.weight"), c)
        for t, h in LAYER:
            out[f"{hf}{h}.weight"] = state[f"{ours}{t}.weight"]
            out[f"{hf}{h}.bias"] = get(f"{ours}{t}.bias", f"{ours}{t}.weight")
    if not c.tie_embeddings:
        out["embed_out.weight"] = state["lm_head.weight"]        # transformers >= 5 renames it lm_head on load
    return out
