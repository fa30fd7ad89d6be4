"""HuggingFace interoperability: import/export GPT-2, Llama, Mistral, Qwen2, BLOOM and BERT folders."""

from tformer.interop.hf import config_from_hf, load_hf, save_hf

__all__ = ["config_from_hf", "load_hf", "save_hf"]
