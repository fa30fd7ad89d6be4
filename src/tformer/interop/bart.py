"""BART <-> tformer's :class:`~tformer.models.seq2seq.EncoderDecoder`: post-norm encoder and
decoder, learned positions (one table per side, read at position + 2), a LayerNorm after each
side's embedding, one shared token matrix tied to the head, and ``final_logits_bias``.

The layer mapping here is also Marian's (:mod:`tformer.interop.marian`): both are fairseq's
transformer. HF keeps q, k and v apart; tformer fuses self-attention's into ``qkv_proj`` and the
cross-attention's k and v into ``kv_proj``.
"""

from __future__ import annotations

import torch

from tformer.config import TransformerConfig
from tformer.interop.loader import TensorSource, refuse, require

MODEL_TYPES = ("bart",)
PREFIX = "model."
POSITION_OFFSET = 2          # BartLearnedPositionalEmbedding reads row position + 2

ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu",
               "silu": "silu", "swish": "silu"}
ACT_TO_HF = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "silu": "silu"}

# (tformer name in a block, HF name in a layer); every entry has .weight and .bias
COMMON = [("attn.out_proj", "self_attn.out_proj"), ("attn_norm", "self_attn_layer_norm"),
          ("ffn.up", "fc1"), ("ffn.down", "fc2"), ("ffn_norm", "final_layer_norm")]
CROSS = [("cross_attn.q_proj", "encoder_attn.q_proj"), ("cross_attn.out_proj", "encoder_attn.out_proj"),
         ("cross_norm", "encoder_attn_layer_norm")]


def common_config(hf: dict, **fields) -> TransformerConfig:
    """The fields BART and Marian share; refuses what one EncoderDecoder config cannot hold."""
    act = hf.get("activation_function", "gelu")
    if act not in ACTIVATIONS:
        raise refuse("activation_function", act, f"known activations are {', '.join(ACTIVATIONS)}.")
    for a, b in (("encoder_attention_heads", "decoder_attention_heads"),):
        if hf[a] != hf[b]:
            raise refuse(b, hf[b], f"tformer's encoder-decoder uses one value for both sides ({a}={hf[a]}).")
    if hf.get("decoder_vocab_size") not in (None, hf["vocab_size"]) or not hf.get("share_encoder_decoder_embeddings", True):
        raise refuse("share_encoder_decoder_embeddings", False, "only one shared source/target vocabulary is implemented.")
    if not hf.get("tie_word_embeddings", True):
        raise refuse("tie_word_embeddings", False, "only the head tied to the shared embedding is implemented.")
    if hf.get("normalize_before", False) or hf.get("add_final_layer_norm", False):
        raise refuse("normalize_before", True, "only post-norm (BART, Marian) is implemented.")
    return TransformerConfig(
        model="encoder-decoder", vocab_size=hf["vocab_size"], context_length=hf.get("max_position_embeddings", 1024),
        n_layers=hf["decoder_layers"], encoder_layers=hf["encoder_layers"], d_model=hf["d_model"],
        n_heads=hf["decoder_attention_heads"], d_ff=hf["decoder_ffn_dim"], norm="layernorm", norm_eps=1e-5,
        encoder_d_ff=hf["encoder_ffn_dim"] if hf["encoder_ffn_dim"] != hf["decoder_ffn_dim"] else None,
        norm_placement="post", ffn="mlp", activation=ACTIVATIONS[act], bias=True, tie_embeddings=True,
        causal=True, embedding_scale=bool(hf.get("scale_embedding", False)), **fields)


def config_from_hf(hf: dict) -> TransformerConfig:
    return common_config(hf, positions="learned", embedding_norm=True, hf_model_type="bart", name="bart")


def layers_from_hf(src: TensorSource, c: TransformerConfig) -> dict:
    """Every encoder and decoder layer, HF names -> tformer names."""
    state = {}
    for side, n, cross in (("encoder", c.encoder_layers or c.n_layers, False), ("decoder", c.n_layers, True)):
        for i in range(n):
            hf, ours = f"{side}.layers.{i}.", f"{side}.blocks.{i}."
            for kind in ("weight", "bias"):
                state[f"{ours}attn.qkv_proj.{kind}"] = torch.cat(
                    [src.take(f"{hf}self_attn.{p}_proj.{kind}") for p in "qkv"])
                for t, h in COMMON + (CROSS if cross else []):
                    state[f"{ours}{t}.{kind}"] = src.take(f"{hf}{h}.{kind}")
                if cross:
                    state[f"{ours}cross_attn.kv_proj.{kind}"] = torch.cat(
                        [src.take(f"{hf}encoder_attn.{p}_proj.{kind}") for p in "kv"])
    return state


def layers_to_hf(state: dict, c: TransformerConfig) -> dict:
    out, d = {}, c.d_model
    for side, n, cross in (("encoder", c.encoder_layers or c.n_layers, False), ("decoder", c.n_layers, True)):
        for i in range(n):
            hf, ours = f"{PREFIX}{side}.layers.{i}.", f"{side}.blocks.{i}."
            for kind in ("weight", "bias"):
                for p, t in zip("qkv", state[f"{ours}attn.qkv_proj.{kind}"].split(d)):
                    out[f"{hf}self_attn.{p}_proj.{kind}"] = t
                for t, h in COMMON + (CROSS if cross else []):
                    out[f"{hf}{h}.{kind}"] = state[f"{ours}{t}.{kind}"]
                if cross:
                    for p, t in zip("kv", state[f"{ours}cross_attn.kv_proj.{kind}"].split(d)):
                        out[f"{hf}encoder_attn.{p}_proj.{kind}"] = t
    return out


def take_shared(src: TensorSource) -> dict:
    """The shared matrix (and its tied copies), the logits bias."""
    emb = src.take("shared.weight")
    for name in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
        src.take_tied(name, emb)
    src.take_lm_head(emb, tied=True)
    bias = src.take("final_logits_bias").reshape(-1) if src.has("final_logits_bias") else torch.zeros(emb.shape[0])
    return {**tie(emb), "logits_bias": bias}


def tie(emb: torch.Tensor) -> dict:
    """The three names of the one shared matrix in tformer's EncoderDecoder."""
    return {"encoder.tok_emb.weight": emb, "decoder.tok_emb.weight": emb, "lm_head.weight": emb}


def state_from_hf(src: TensorSource, c: TransformerConfig) -> dict:
    state = take_shared(src)
    for side in ("encoder", "decoder"):
        state[f"{side}.pos_emb.weight"] = src.take(f"{side}.embed_positions.weight")[POSITION_OFFSET:]
        for kind in ("weight", "bias"):
            state[f"{side}.emb_norm.{kind}"] = src.take(f"{side}.layernorm_embedding.{kind}")
    state.update(layers_from_hf(src, c))
    return state


def common_to_hf(c: TransformerConfig, model_type: str, architecture: str) -> dict:
    return {
        "architectures": [architecture], "model_type": model_type, "vocab_size": c.vocab_size,
        "d_model": c.d_model, "encoder_layers": c.encoder_layers or c.n_layers, "decoder_layers": c.n_layers,
        "encoder_attention_heads": c.n_heads, "decoder_attention_heads": c.n_heads,
        "encoder_ffn_dim": c.encoder_d_ff or c.d_ff, "decoder_ffn_dim": c.d_ff, "activation_function": ACT_TO_HF[c.activation],
        "max_position_embeddings": c.context_length, "scale_embedding": c.embedding_scale,
        "dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0, "tie_word_embeddings": True,
        "is_encoder_decoder": True,
    }


def config_to_hf(c: TransformerConfig, model_type: str) -> dict:
    return {**common_to_hf(c, "bart", "BartForConditionalGeneration"),
            "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2, "decoder_start_token_id": 2}


def check_common(c: TransformerConfig, model_type: str, **fields) -> None:
    require(c, model_type, model="encoder-decoder", mixer="attention", norm="layernorm", norm_eps=1e-5, norm_placement="post",
            ffn="mlp", bias=True, qkv_bias=True, n_kv_heads=c.n_heads, head_dim=c.d_model // c.n_heads,
            sliding_window=None, **fields)


def model_type_for(c: TransformerConfig) -> str | None:
    """``"bart"`` for an encoder-decoder of softmax attention with learned positions, else ``None``."""
    return "bart" if c.model == "encoder-decoder" and c.mixer == "attention" and c.positions == "learned" else None


def check_exportable(c: TransformerConfig, model_type: str) -> None:
    check_common(c, model_type, positions="learned", embedding_norm=True)


def shared_to_hf(state: dict) -> dict:
    return {f"{PREFIX}shared.weight": state["encoder.tok_emb.weight"], "final_logits_bias": state["logits_bias"][None]}


def state_to_hf(state: dict, c: TransformerConfig) -> dict:
    out = shared_to_hf(state)
    for side in ("encoder", "decoder"):
        table = state[f"{side}.pos_emb.weight"]
        out[f"{PREFIX}{side}.embed_positions.weight"] = torch.cat([table.new_zeros(POSITION_OFFSET, c.d_model), table])
        for kind in ("weight", "bias"):
            out[f"{PREFIX}{side}.layernorm_embedding.{kind}"] = state[f"{side}.emb_norm.{kind}"]
    out.update(layers_to_hf(state, c))
    return out
