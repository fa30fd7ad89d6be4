"""Which kernel each linear layer of a model runs, in words, for benchmark tables.

After :func:`tformer.quant.quantize.set_precision` every linear layer is an ``nn.Linear``, a
``DecodeLinear``, an ``Int8Linear`` / ``Int4Linear`` or a ``BlockLinear``, and the decode layers carry the ``kernel`` they
chose (measured by :mod:`tformer.quant.kernels`). :func:`linear_kernels` reads those choices back from
the modules themselves, so a table's "kernel" column names what ran, not what was meant to run
(:func:`tformer.fused.report.kernels_of` adds whether the layers run whole in one C++ call).
"""

from __future__ import annotations

import torch

from tformer.quant import gemv, qgemv
from tformer.quant.block_linear import BlockLinear
from tformer.quant.quantize import KERNEL_DTYPE, DecodeLinear, Int4Linear, Int8Linear

KERNEL_NAMES = {"ext": "tformer GEMV (gemv.cpp)", "mv": "torch.mv(W, x)", "linear": "F.linear",
                "mm_t": "torch.addmm(x, Wᵀ stored (K, N))", "int8pack": "aten._weight_int8pack_mm",
                "int4pack": "aten._weight_int4pack_mm_for_cpu"}


def linear_kernel(m: torch.nn.Module) -> str | None:
    """What one linear-like module runs for a decode step (one row), read from the kernel it chose
    (``DecodeLinear`` / ``Int8Linear`` / ``Int4Linear`` ``.kernel``); ``None`` for a module that is not one."""
    if isinstance(m, (Int8Linear, Int4Linear)):
        bits = "int8" if isinstance(m, Int8Linear) else "int4"
        return f"{KERNEL_NAMES[m.kernel]} ({bits} W, {str(KERNEL_DTYPE)[6:]} x)"
    if isinstance(m, BlockLinear):
        return f"tformer block products (qgemv.cpp, {qgemv.path()}) {m.fmt}"
    if isinstance(m, DecodeLinear):
        name = KERNEL_NAMES[m.kernel] + (f" {gemv.path()}" if m.kernel == "ext" else "")
        tail = "" if m.kernel in ("linear", "mm_t") else \
            {"fp32": " (F.linear for prefill, widened to float32)", "tiles": " (gemv.cpp tiles for prefill)"}.get(
                m.prefill, " (F.linear for prefill)")
        return f"{name} {str(m.weight.dtype)[6:]}{tail}"
    if isinstance(m, torch.nn.Linear):
        return f"F.linear (nn.Linear) {str(m.weight.dtype)[6:]}"
    if type(m).__name__ == "Conv1D":                                   # HF GPT-2's projections
        return f"HF Conv1D (torch.addmm) {str(m.weight.dtype)[6:]}"
    return None


def linear_kernels(model: torch.nn.Module) -> str:
    """The kernels a model's linear layers run, with how many layers run each: ``"48x F.linear float32"``."""
    counts: dict[str, int] = {}
    for m in model.modules():
        k = linear_kernel(m)
        if k is not None:
            counts[k] = counts.get(k, 0) + 1
    return "; ".join(f"{n}x {k}" for k, n in counts.items()) or "no linear layers"
