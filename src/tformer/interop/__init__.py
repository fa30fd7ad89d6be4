"""HuggingFace and GGUF interoperability: one converter module per HF family (``gpt2``, ``llama``, ...),
``hf`` (load_hf / save_hf, the FAMILIES registry), ``gguf`` and ``sentence`` (sentence-transformers)."""
