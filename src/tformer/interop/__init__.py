"""HuggingFace and GGUF interoperability: one converter module per HF family (``gpt2``, ``llama``, ...),
``hf`` (load_hf / save_hf, the FAMILIES registry), ``gguf``, ``llama_cpp`` (llama.cpp on an exported GGUF,
through llama-cpp-python) and ``sentence`` (sentence-transformers)."""
