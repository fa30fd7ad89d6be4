"""Boolean attention masks. Convention everywhere in tformer: ``True`` means "may attend".

Causal masks are aligned bottom-right: with ``n`` queries and ``m >= n`` keys the queries are
the *last* ``n`` positions of the key sequence (as in cached decoding), so query ``i`` sees
keys ``j <= i + (m - n)``. This matches PyTorch's ``causal_lower_right`` and FlashAttention 2.
"""

from __future__ import annotations

import torch

from tformer.errors import InputError

Tensor = torch.Tensor


def causal_mask(n: int, m: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Bottom-right aligned causal mask.

    Args:
        n: number of queries; m: number of keys.
    Returns:
        ``(n, m)`` bool tensor, ``True`` where query ``i`` may attend key ``j``.
    """
    i = torch.arange(n, device=device).unsqueeze(1)
    j = torch.arange(m, device=device).unsqueeze(0)
    return j <= i + (m - n)


def sliding_window_mask(
    n: int, m: int, window: int, causal: bool = True, device: torch.device | str | None = None
) -> torch.Tensor:
    """Local attention: query ``i`` (at key position ``p = i + m - n``) sees keys in ``(p - window, p]``.

    With ``causal=False`` the band is symmetric: ``|p - j| < window``.

    Returns:
        ``(n, m)`` bool tensor.
    """
    if window < 1:
        raise InputError(f"window={window} must be >= 1.")
    p = torch.arange(n, device=device).unsqueeze(1) + (m - n)
    j = torch.arange(m, device=device).unsqueeze(0)
    near = (p - j).abs() < window
    return near & (j <= p) if causal else near


def padding_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Key-padding mask from a ``(B, m)`` tensor of 1 (token) / 0 (padding).

    Returns:
        ``(B, 1, 1, m)`` bool tensor that broadcasts over heads and queries.
    """
    if attention_mask.dim() != 2:
        raise InputError(
            f"attention_mask must have shape (batch, seq_len), got {tuple(attention_mask.shape)}."
        )
    return attention_mask.bool()[:, None, None, :]


def masked_softmax(scores: Tensor, ok: Tensor) -> Tensor:
    """Softmax over the last dimension of ``scores`` where ``ok``; rows with no ``ok`` entry give zeros."""
    scores = scores.masked_fill(~ok, float("-inf"))
    top = scores.amax(dim=-1, keepdim=True).detach()
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    e = torch.exp(scores - top)                                               # exp(-inf) = 0 where masked
    return e / e.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(e.dtype).tiny)
