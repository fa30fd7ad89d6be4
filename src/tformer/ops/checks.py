"""Shape checks shared by every attention backend (the functional entry point and flash)."""

from __future__ import annotations

import torch

from tformer.errors import InputError

Tensor = torch.Tensor


def check_shapes(q: Tensor, k: Tensor, v: Tensor) -> None:
    if q.dim() < 2 or k.dim() < 2 or v.dim() < 2:
        raise InputError("q, k and v need at least 2 dims (seq_len, dim).")
    if q.shape[-1] != k.shape[-1]:
        raise InputError(f"q and k must share d_k: q has {q.shape[-1]}, k has {k.shape[-1]}.")
    if k.shape[:-1] != v.shape[:-1]:
        raise InputError(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree on every dim but the last "
            f"(one value per key)."
        )
    if q.dim() >= 3 and k.dim() == q.dim() and q.shape[-3] % k.shape[-3] != 0:
        raise InputError(
            f"{q.shape[-3]} query heads are not a multiple of {k.shape[-3]} key/value heads."
        )
