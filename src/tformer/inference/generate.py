"""Autoregressive generation: repeatedly predict the next token and append it.

This first version recomputes the whole window for every new token (no KV cache), like nanoGPT.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    ids: Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int | None = None,
) -> Tensor:
    """Continue ``ids (B, T)`` by ``max_new_tokens`` tokens.

    Args:
        temperature: 0 is greedy; higher is more random.
        top_k: sample only among the k most likely tokens.
        seed: makes sampling reproducible.
    Returns:
        ``(B, T + max_new_tokens)`` ids.
    """
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 = greedy).")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k} must be >= 1.")
    gen = torch.Generator(device=ids.device).manual_seed(seed) if seed is not None else None
    context = model.config.context_length
    was_training = model.training
    model.eval()
    for _ in range(max_new_tokens):
        logits, _ = model(ids[:, -context:])
        logits = logits[:, -1, :].float()                                     # (B, vocab)
        if temperature == 0:
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)
        ids = torch.cat([ids, nxt], dim=1)
    model.train(was_training)
    return ids
