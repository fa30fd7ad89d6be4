"""Hardware facts the trainer measures instead of assuming: bf16 support and the matmul peak."""

from __future__ import annotations

import time

import torch


def bf16_supported(device: str = "cpu") -> bool:
    """Whether bf16 autocast runs natively: a CUDA GPU with bf16, or a CPU with AVX-512-BF16 / AMX."""
    if device.startswith("cuda"):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def matmul_peak_flops(dtype: torch.dtype = torch.float32, device: str = "cpu", n: int = 1024,
                      seconds: float = 0.3) -> float:
    """FLOP/s of the fastest of repeated ``(n, n) @ (n, n)`` products: the peak MFU is measured against.

    A square matmul of this size is about the best case for the BLAS library on this machine, so
    it is a practical ceiling (not the datasheet's) for what a training step could reach.
    """
    gen = torch.Generator().manual_seed(0)          # a private generator: training's RNG stream is untouched
    a = torch.randn(n, n, generator=gen).to(device, dtype)
    b = torch.randn(n, n, generator=gen).to(device, dtype)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(2):
        a @ b
    sync()
    best, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < seconds:
        t = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best
