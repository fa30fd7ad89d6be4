"""tformer: the transformer, done completely and done well, in PyTorch."""

from tformer.accounting import count_parameters, kv_cache_bytes, training_flops_per_token
from tformer.attention.functional import choose_backend, scaled_dot_product_attention
from tformer.attention.multihead import MultiHeadAttention
from tformer.config import PRESETS, TransformerConfig
from tformer.models.decoder import DecoderLM
from tformer.models.encoder import EncoderModel

__version__ = "0.1.0"

__all__ = [
    "PRESETS",
    "DecoderLM",
    "EncoderModel",
    "MultiHeadAttention",
    "TransformerConfig",
    "choose_backend",
    "count_parameters",
    "kv_cache_bytes",
    "scaled_dot_product_attention",
    "training_flops_per_token",
]
