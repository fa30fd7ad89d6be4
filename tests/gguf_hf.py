"""Test fixtures that write a ``transformers`` model as a GGUF file with the ``gguf`` package (gguf-py, llama.cpp's
own writer), so that tformer's reader is checked against files it did not write (never with
:mod:`tformer.interop.gguf`). Used by tests/interop/families.py and tests/quant/kquant_files.py."""

from __future__ import annotations


def add_llama_hyperparameters(w, c) -> None:
    """The ``{arch}.*`` keys every Llama-shaped architecture (llama, qwen2, qwen3) needs, from HF config ``c``:
    sizes, heads, the RMSNorm epsilon and the RoPE base."""
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(float(c.rms_norm_eps))
    rope = c.rope_parameters
    w.add_rope_freq_base(float(rope.get("full_attention", rope)["rope_theta"]))     # Gemma 3: the global layers'


def finish(w) -> None:
    """Write the header, metadata and tensors added to ``w`` and close the file."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
