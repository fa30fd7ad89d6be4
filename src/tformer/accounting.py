"""What a model costs, computed from its config alone: parameters, FLOPs, inference-state bytes.

The parameter count by component equals ``sum(p.numel())`` of the built model exactly (the tests
check every preset). For a bias-free MHA block with a 4d GELU MLP, a layer holds
4d² in attention (W_Q, W_K, W_V, W_O) and 8d² in the MLP: 12d² per layer, two-thirds in the MLP.
Each layer's token mixer reports its own parameters and state bytes (``count_parameters`` and
``state_bytes`` of the classes in ``tformer.mixers.MIXERS``), so a new mixer is counted unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

from tformer.config import TransformerConfig
from tformer.errors import ConfigError
from tformer.mixers import check_config, mixer_class
from tformer.mixers.attention import CrossAttention


@dataclass(frozen=True)
class ParameterCount:
    """Parameters by component. ``per_layer_*`` are for one block; ``mixer_layers`` holds each
    layer's token mixer (they differ in a hybrid stack)."""

    embedding: int          # token embedding (also the LM head when tied)
    positions: int          # learned position table (0 for the other schemes)
    token_types: int        # token-type (segment) embeddings, BERT
    embedding_norm: int     # norm after the embedding sum (BERT, BLOOM)
    mixer_layers: tuple[int, ...]
    per_layer_ffn: int
    per_layer_norms: int
    n_layers: int
    final_norm: int
    lm_head: int            # 0 when tied to the embedding
    tied_head: bool = True

    @property
    def per_layer_attention(self) -> int:
        """The token mixer of one layer (every layer's alike; a hybrid stack has ``mixer_layers``)."""
        if len(set(self.mixer_layers)) > 1:
            raise ConfigError("the layers' mixers differ in size (a hybrid stack); read mixer_layers instead.")
        return self.mixer_layers[0]

    @property
    def layers(self) -> int:
        return sum(self.mixer_layers) + self.n_layers * (self.per_layer_ffn + self.per_layer_norms)

    @property
    def non_embedding(self) -> int:
        """Kaplan et al.'s N: everything but the embeddings (and a separate head)."""
        return self.embedding_norm + self.layers + self.final_norm

    @property
    def total(self) -> int:
        return (self.embedding + self.positions + self.token_types + self.embedding_norm
                + self.layers + self.final_norm + self.lm_head)

    def table(self) -> str:
        rows = [
            ("token embedding", self.embedding),
            ("position embedding", self.positions),
            ("token-type embedding", self.token_types),
            ("embedding norm", self.embedding_norm),
            (self._mixer_label(), sum(self.mixer_layers)),
            (f"feed-forward ({self.n_layers} x {self.per_layer_ffn:,})", self.n_layers * self.per_layer_ffn),
            (f"norms ({self.n_layers} x {self.per_layer_norms:,})", self.n_layers * self.per_layer_norms),
            ("final norm", self.final_norm),
            ("LM head (tied: the token embedding)" if self.tied_head else "LM head", self.lm_head),
            ("total", self.total),
        ]
        width = max(len(r[0]) for r in rows)
        return "\n".join(f"{name:<{width}}  {value:>15,}" for name, value in rows)


    def _mixer_label(self) -> str:
        if len(set(self.mixer_layers)) == 1:
            return f"token mixers ({self.n_layers} x {self.mixer_layers[0]:,})"
        return f"token mixers ({self.n_layers} layers, hybrid)"


def _norm_params(c: TransformerConfig) -> int:
    return c.d_model * (2 if (c.norm == "layernorm" and c.bias) else 1)


def count_parameters(config: TransformerConfig, cross_attention: bool = False) -> ParameterCount:
    """Parameters of a decoder (or encoder) built from ``config``, by component.

    Args:
        cross_attention: count an extra cross-attention sub-layer (and its norm) per block.
    """
    check_config(config)
    c = config
    d = c.d_model
    if c.ffn in ("swiglu", "geglu"):
        ffn = 3 * d * c.d_ff + (2 * c.d_ff + d) * c.bias
    elif c.ffn == "mlp":
        ffn = 2 * d * c.d_ff + (c.d_ff + d) * c.bias
    else:
        ffn = 0
    norms = (2 if c.ffn != "none" else 1) * _norm_params(c) * (2 if c.post_norms else 1)   # Gemma's post-norms
    mixers = [mixer_class(name).count_parameters(c) for name in c.layer_mixers()]
    if cross_attention:
        mixers = [m + CrossAttention.count_parameters(c) for m in mixers]
        norms += _norm_params(c)
    return ParameterCount(
        embedding=c.vocab_size * d,
        positions=c.context_length * d if c.positions == "learned" else 0,
        token_types=c.type_vocab_size * d,
        embedding_norm=_norm_params(c) if c.embedding_norm else 0,
        mixer_layers=tuple(mixers),
        per_layer_ffn=ffn,
        per_layer_norms=norms,
        n_layers=c.n_layers,
        final_norm=_norm_params(c) if c.norm_placement == "pre" else 0,
        lm_head=0 if c.tie_embeddings else c.vocab_size * d,
        tied_head=c.tie_embeddings,
    )


def training_flops_per_token(config: TransformerConfig, seq_len: int | None = None) -> int:
    """Training FLOPs per token: ``6 N + 12 L T (n_heads · head_dim)`` (PaLM, appendix B).

    ``6N``: forward (2 FLOPs per multiply-add per parameter) plus backward (twice the forward),
    with N the non-embedding parameters plus the LM-head matrix (it is a matmul for every token,
    tied or not). ``12 L T d_attn``: the attention scores and the weighted sum, which no parameter
    counts, for each attention layer; every mixer reports such work through ``extra_training_flops_per_token``.
    ``seq_len`` defaults to the context length.
    """
    c = config
    T = c.context_length if seq_len is None else seq_len
    n = count_parameters(c).non_embedding + c.vocab_size * c.d_model
    extra = 0
    for i, name in enumerate(c.layer_mixers()):   # work no parameter counts: attention's scores, a scan, ...
        cls = mixer_class(name)
        if hasattr(cls, "extra_training_flops_per_token"):
            extra += cls.extra_training_flops_per_token(c, T, layer=i)
    return 6 * n + extra


def kv_cache_bytes(config: TransformerConfig, n_tokens: int, batch_size: int = 1, bytes_per_element: int = 4) -> int:
    """Bytes of a KV cache: ``2 · L · n · h_kv · d_head · bytes`` per sequence (keys and values).

    GQA/MQA shrink it by ``n_heads / n_kv_heads`` against MHA.
    """
    c = config
    return 2 * c.n_layers * n_tokens * c.n_kv_heads * c.head_dim * bytes_per_element * batch_size


def state_bytes(config: TransformerConfig, n_tokens: int, batch_size: int = 1, bytes_per_element: int = 4) -> int:
    """Bytes of a whole model's inference state for ``n_tokens`` tokens: each layer's mixer state
    (a KV cache for attention, a fixed-size recurrent state for others), summed over the layers."""
    return sum(mixer_class(name).state_bytes(config, n_tokens, batch_size, bytes_per_element)
               for name in config.layer_mixers())
