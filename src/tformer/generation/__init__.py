"""Inference: KV cache and generation."""
