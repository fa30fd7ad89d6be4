"""Linformer attention (Wang et al., 2020): keys and values projected along the sequence to length k.

    head = softmax( Q (E K)ᵀ / sqrt(d) ) (F V),     E, F: (k, n) learned

``E K`` is ``(k, d)``, so the scores are ``(n, k)``: O(n·k) time and memory. The paper's argument:
the attention matrix is close to low rank, so k ≈ 256 rows of mixed keys carry it. Sharing options
(paper §4): one ``E``/``F`` pair per head, one pair per layer shared by the heads ("headwise"), or
``E = F`` per layer ("key-value"). A sequence shorter than the model's ``n`` uses the first ``n``
columns of ``E`` and ``F``; padding keys and values are zeroed before the projection.

Every output position mixes every input position through ``E``, so Linformer is bidirectional
only: there is no causal form (a row of ``E`` sums over future tokens).
"""

from __future__ import annotations

import math

import torch

Tensor = torch.Tensor


def linformer_attention(q: Tensor, k: Tensor, v: Tensor, E: Tensor, F: Tensor, *,
                        key_mask: Tensor | None = None, scale: float | None = None) -> Tensor:
    """Attention over ``k`` projected keys/values.

    Args:
        q, k, v: ``(B, H, n, e)``.
        E, F: ``(H or 1, k, n_max)`` sequence projections of keys and values, ``n <= n_max``.
        key_mask: ``(B, n)`` bool, ``False`` = padding (zeroed before projecting).
    Returns:
        ``(B, H, n, e)``.
    """
    n, e = q.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(e) if scale is None else scale
    if key_mask is not None:
        keep = key_mask[:, None, :, None].to(k.dtype)                        # (B, 1, n, 1)
        k, v = k * keep, v * keep
    kp = torch.matmul(E[..., :n].to(k.dtype), k)                             # (B, H, k, e)
    vp = torch.matmul(F[..., :n].to(v.dtype), v)                             # (B, H, k, e)
    s = torch.matmul(q, kp.transpose(-1, -2)) * scale                        # (B, H, n, k)
    return torch.matmul(torch.softmax(s, dim=-1), vp)                        # (B, H, n, e)
