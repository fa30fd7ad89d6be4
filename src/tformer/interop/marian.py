"""Marian (MarianMT) <-> tformer's :class:`~tformer.models.seq2seq.EncoderDecoder`: BART's layers
(:mod:`tformer.interop.bart`) with fixed sinusoidal positions, no embedding LayerNorm, and
usually ``scale_embedding`` (token embeddings times sqrt(d)).

Marian's sinusoids are not interleaved: coordinate ``j < d/2`` holds ``sin(p / 10000^(2j/d))``
and ``d/2 + j`` the matching cosine, where tformer's table (Vaswani's) puts them at ``2j`` and
``2j + 1``. The two tables are the same columns in another order, so the converter renames the
residual stream's coordinates: every matrix reading the stream has its input columns permuted,
every one writing it its output rows, and every LayerNorm its gain and bias (a LayerNorm treats
coordinates alike). The network computes exactly the same function; no table is stored
(Marian's files do not hold one either).
"""

from __future__ import annotations

import torch

from tformer.config import TransformerConfig
from tformer.interop import bart
from tformer.interop.loader import TensorSource, refuse

MODEL_TYPES = ("marian",)
PREFIX = bart.PREFIX

READS = ("tok_emb.weight", "qkv_proj.weight", "q_proj.weight", "kv_proj.weight", "ffn.up.weight")  # columns
WRITES = ("out_proj.weight", "out_proj.bias", "ffn.down.weight", "ffn.down.bias")                  # rows


def halves_order(d: int) -> torch.Tensor:
    """``order[j]`` = the tformer coordinate Marian's coordinate ``j`` holds: 0, 2, 4, ..., 1, 3, 5, ..."""
    return torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])


def permute_stream(state: dict, order: torch.Tensor) -> dict:
    """Reorder the residual-stream coordinates of every tensor: new coordinate ``j`` = old ``order[j]``."""
    out = {}
    for name, t in state.items():
        if name.endswith(READS):
            t = t[:, order]
        elif name.endswith(WRITES) or "norm." in name:
            t = t[order]
        out[name] = t
    return out


def config_from_hf(hf: dict) -> TransformerConfig:
    if hf["d_model"] % 2:
        raise refuse("d_model", hf["d_model"], "Marian's sinusoids need an even width.")
    return bart.common_config(hf, positions="sinusoidal", embedding_norm=False, hf_model_type="marian", name="marian")


def state_from_hf(src: TensorSource, c: TransformerConfig) -> dict:
    src.drop("encoder.embed_positions.weight", "decoder.embed_positions.weight")  # fixed sinusoids, rebuilt
    state = {**bart.take_shared(src), **bart.layers_from_hf(src, c)}
    inverse = torch.argsort(halves_order(c.d_model))                   # Marian's layout -> tformer's
    state = permute_stream(state, inverse)
    return {**state, **bart.tie(state["encoder.tok_emb.weight"])}             # one matrix again after permuting


def config_to_hf(c: TransformerConfig, model_type: str) -> dict:
    pad = c.vocab_size - 1                                              # Marian: pad = last id = decoder start
    return {**bart.common_to_hf(c, "marian", "MarianMTModel"), "pad_token_id": pad, "decoder_start_token_id": pad,
            "eos_token_id": 0, "share_encoder_decoder_embeddings": True, "static_position_embeddings": True}


def model_type_for(c: TransformerConfig) -> str | None:
    """``"marian"`` for an encoder-decoder of softmax attention with sinusoidal positions, else ``None``."""
    return "marian" if c.model == "encoder-decoder" and c.mixer == "attention" and c.positions == "sinusoidal" else None


def check_exportable(c: TransformerConfig, model_type: str) -> None:
    bart.check_common(c, model_type, positions="sinusoidal", embedding_norm=False)


def state_to_hf(state: dict, c: TransformerConfig) -> dict:
    state = permute_stream(state, halves_order(c.d_model))
    return {**bart.shared_to_hf(state), **bart.layers_to_hf(state, c)}
