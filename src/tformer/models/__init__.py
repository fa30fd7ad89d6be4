"""Model families built from a TransformerConfig."""

from tformer.models.decoder import DecoderLM
from tformer.models.encoder import EncoderModel

__all__ = ["DecoderLM", "EncoderModel"]
