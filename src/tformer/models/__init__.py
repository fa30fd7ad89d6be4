"""Model families built from a TransformerConfig."""

from tformer.models.decoder import DecoderLM

__all__ = ["DecoderLM"]
