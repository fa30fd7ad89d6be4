"""Which kernels a model's decode steps run, in words, for benchmark tables."""

from __future__ import annotations

import torch

from tformer.fused.plan import chosen
from tformer.quant.report import linear_kernels


def kernels_of(model: torch.nn.Module) -> str:
    """The kernels a model's linear layers run, with how many layers run each (``"48x F.linear float32"``,
    :func:`tformer.quant.report.linear_kernels`), after ``"decode: 12 layers, whole layers in one C++
    call (avx2 kernels, q8_0 blocks)"`` where its calls take :mod:`tformer.fused` (the layers' products
    then run inside those calls, the head as listed). Asking makes the model's choice (a float
    weight stored transposed is laid back)."""
    text = linear_kernels(model)
    choice = chosen(model) if hasattr(model, "blocks") else None
    if choice is None or choice.plan is None:
        return text
    return f"decode: {len(choice.plan.layers)} layers, {choice.reason}; {text}"
