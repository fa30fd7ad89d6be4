"""Mamba (``MambaForCausalLM``) <-> tformer: a stack of pre-norm Mamba blocks, no feed-forward.

HF's block is ``x + mixer(rmsnorm(x))`` with a final ``norm_f``: tformer's pre-norm decoder with
``mixer="mamba"``, ``ffn="none"``, ``norm="rmsnorm"``, ``positions="none"``. The mixer's tensors keep
their names except ``dt_proj.bias``, which tformer holds as ``dt_bias`` (a parameter of its own, so
the generic Linear initialisation does not overwrite Mamba's Δ initialisation). HF's
``residual_in_fp32`` changes nothing in fp32, which is what tformer converts in.
"""

from __future__ import annotations

import math

from tformer.config import TransformerConfig
from tformer.errors import ConfigError
from tformer.interop.loader import TensorSource, refuse, require
from tformer.mixers.mamba import MambaShape

MODEL_TYPES = ("mamba",)
PREFIX = "backbone."
NORM, MIXER = "attn_norm", "attn"   # the Block keeps these names whatever its mixer (tformer.models.block.Block)

# tformer name (under blocks.{i}.{MIXER}.) -> HF name (under layers.{i}.mixer.)
MIXER_TENSORS = [("in_proj.weight", "in_proj.weight"), ("conv1d.weight", "conv1d.weight"),
                 ("x_proj.weight", "x_proj.weight"), ("dt_proj.weight", "dt_proj.weight"),
                 ("dt_bias", "dt_proj.bias"), ("A_log", "A_log"), ("D", "D"), ("out_proj.weight", "out_proj.weight")]
BIASES = [("in_proj.bias", "in_proj.bias"), ("out_proj.bias", "out_proj.bias")]
CONV_BIAS = [("conv1d.bias", "conv1d.bias")]
CONTEXT = 1 << 16   # Mamba has no position limit; tformer's context_length only bounds prompt + generation


def config_from_hf(hf: dict) -> TransformerConfig:
    if hf.get("hidden_act", "silu") != "silu":
        raise refuse("hidden_act", hf["hidden_act"], "the Mamba converter supports silu only.")
    d = hf["hidden_size"]
    expand = hf.get("expand", 2)
    if hf.get("intermediate_size", expand * d) != expand * d:
        raise refuse("intermediate_size", hf["intermediate_size"], f"tformer needs expand * hidden_size = {expand * d}.")
    rank = hf.get("time_step_rank", "auto")
    options = dict(d_state=hf.get("state_size", 16), expand=expand, d_conv=hf.get("conv_kernel", 4),
                   dt_rank="auto" if rank == "auto" or rank == math.ceil(d / 16) else int(rank),
                   conv_bias=bool(hf.get("use_conv_bias", True)))
    return TransformerConfig(
        vocab_size=hf["vocab_size"], context_length=hf.get("max_position_embeddings", CONTEXT),
        n_layers=hf["num_hidden_layers"], d_model=d, n_heads=1, positions="none", norm="rmsnorm",
        norm_eps=hf.get("layer_norm_epsilon", 1e-5), norm_placement="pre", ffn="none",
        bias=bool(hf.get("use_bias", False)), tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        mixer="mamba", mixer_options={"mamba": options}, hf_model_type="mamba", name="mamba",
    )


def _layer_tensors(c: TransformerConfig) -> list[tuple[str, str]]:
    s = MambaShape.of(c)
    return MIXER_TENSORS + (BIASES if s.bias else []) + (CONV_BIAS if s.conv_bias else [])


def state_from_hf(src: TensorSource, c: TransformerConfig) -> dict:
    emb = "embeddings.weight" if src.has("embeddings.weight") else "embedding.weight"  # older checkpoints
    state = {"tok_emb.weight": src.take(emb), "final_norm.weight": src.take("norm_f.weight")}
    for i in range(c.n_layers):
        hf, ours = f"layers.{i}.", f"blocks.{i}."
        state[f"{ours}{NORM}.weight"] = src.take(hf + "norm.weight")
        for t, h in _layer_tensors(c):
            state[f"{ours}{MIXER}.{t}"] = src.take(f"{hf}mixer.{h}")
    state["lm_head.weight"] = src.take_lm_head(state["tok_emb.weight"], c.tie_embeddings)
    return state


def config_to_hf(c: TransformerConfig, model_type: str = "mamba") -> dict:
    s = MambaShape.of(c)
    return {
        "architectures": ["MambaForCausalLM"], "model_type": "mamba", "vocab_size": c.vocab_size,
        "hidden_size": c.d_model, "state_size": s.N, "num_hidden_layers": c.n_layers,
        "layer_norm_epsilon": c.norm_eps, "expand": s.E // s.d, "intermediate_size": s.E, "conv_kernel": s.K,
        "use_bias": s.bias, "use_conv_bias": s.conv_bias, "hidden_act": "silu", "time_step_rank": s.R,
        "residual_in_fp32": True, "tie_word_embeddings": c.tie_embeddings,
    }


def model_type_for(c: TransformerConfig) -> str | None:
    """``"mamba"`` for a decoder whose every layer is Mamba, else ``None``."""
    return "mamba" if c.model == "decoder" and c.mixer == "mamba" else None


def check_exportable(c: TransformerConfig, model_type: str = "mamba") -> None:
    """Refuse a tformer config HF's Mamba cannot express, naming the field."""
    require(c, "mamba", mixer="mamba", ffn="none", norm="rmsnorm", norm_placement="pre", positions="none",
            embedding_norm=False, type_vocab_size=0, causal=True)
    if not MambaShape.of(c).selective:
        raise ConfigError("cannot export as mamba: it needs mixer_options['mamba']['selective']=True, the model "
                         "is the LTI ablation.")


def state_to_hf(state: dict, c: TransformerConfig) -> dict:
    out = {PREFIX + "embeddings.weight": state["tok_emb.weight"], PREFIX + "norm_f.weight": state["final_norm.weight"]}
    for i in range(c.n_layers):
        hf, ours = f"{PREFIX}layers.{i}.", f"blocks.{i}."
        out[hf + "norm.weight"] = state[f"{ours}{NORM}.weight"]
        for t, h in _layer_tensors(c):
            out[f"{hf}mixer.{h}"] = state[f"{ours}{MIXER}.{t}"]
    if not c.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    return out
