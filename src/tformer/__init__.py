"""tformer: the transformer, done completely and done well, in PyTorch.

The names the README's examples use are importable from here; each also lives in its own module
(``tformer.checkpoint``, ``tformer.generation.text``, ...), which is where to read it.
"""

from tformer.accounting import count_parameters, kv_cache_bytes, state_bytes, training_flops_per_token
from tformer.ops.flash import flash_attention
from tformer.ops.sdpa import choose_backend, scaled_dot_product_attention
from tformer.mixers.attention import MultiHeadAttention
from tformer.checkpoint import load_model, save_model
from tformer.config import PRESETS, TransformerConfig
from tformer.errors import CheckpointError, ConfigError, InputError, TformerError
from tformer.generation.generate import GenerationOptions, generate, generate_tokens
from tformer.quant.quantize import set_precision
from tformer.models.state import InferenceState
from tformer.generation.step import decode_step, prefill
from tformer.generation.text import generate_text, stream_text
from tformer.mixers import MIXERS, register_mixer
from tformer.models import MODELS, build_model
from tformer.models.decoder import DecoderLM
from tformer.models.encoder import EncoderModel
from tformer.tokenizers import load_tokenizer

__version__ = "0.1.0"

__all__ = [
    "MIXERS", "MODELS", "PRESETS", "CheckpointError", "ConfigError", "DecoderLM", "EncoderModel",
    "GenerationOptions", "InferenceState", "InputError", "MultiHeadAttention", "TformerError",
    "TransformerConfig", "build_model", "choose_backend", "count_parameters", "decode_step", "flash_attention",
    "generate", "generate_text", "generate_tokens", "kv_cache_bytes", "load_model", "load_tokenizer", "prefill",
    "register_mixer", "save_model", "scaled_dot_product_attention", "set_precision", "state_bytes",
    "stream_text", "training_flops_per_token",
]
