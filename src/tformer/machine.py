"""Hardware facts the trainer, the server and the benchmarks measure instead of assuming: the CPU's
model name and vector instruction sets, bf16 support, the matmul peak, the cores this process may use,
how many of them other processes keep busy (and so how many threads to run), and the memory still available."""

from __future__ import annotations

import functools
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

_DEFAULT_THREADS = torch.get_num_threads()      # torch's own choice, before anyone sets it


# The instruction sets a CPU speed depends on, as named in a report -> the /proc/cpuinfo flag that has it.
INSTRUCTION_SETS = {
    "AVX2": "avx2",
    "AVX-512": "avx512f",              # the foundation; every other AVX-512 set needs it
    "AVX512_VNNI": "avx512_vnni",      # int8 dot products on 512-bit vectors
    "AVX-VNNI": "avx_vnni",            # the same on 256-bit vectors (also on CPUs without AVX-512)
    "AVX512_BF16": "avx512_bf16",      # bf16 dot products (VDPBF16PS)
    "AMX": "amx_tile",                 # tile registers and matrix multiply units (Sapphire Rapids and later)
}


@dataclass(frozen=True)
class CPU:
    """What ``/proc/cpuinfo`` says about the processor: its model name and which of
    :data:`INSTRUCTION_SETS` its flags list. ``str()`` gives one line for a report."""

    model: str
    instruction_sets: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.model} ({', '.join(self.instruction_sets) or 'none of ' + ', '.join(INSTRUCTION_SETS)})"


def cpu_info(cpuinfo: str | None = None) -> CPU:
    """The CPU's model name and instruction sets, read from ``cpuinfo`` (the text of
    ``/proc/cpuinfo``; read from the file when None). The first processor's ``model name`` and
    ``flags`` lines are used (a machine's cores are alike); where the file is missing (not Linux),
    the model is ``platform.processor()`` and no instruction set is claimed."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    model, flags = "", set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "features") and not flags:             # "Features" on ARM
            flags = set(value.split())
    model = model or platform.processor() or platform.machine() or "unknown CPU"
    return CPU(model, tuple(name for name, flag in INSTRUCTION_SETS.items() if flag in flags))


def bf16_supported(device: str = "cpu") -> bool:
    """Whether bf16 autocast runs natively: a CUDA GPU with bf16, or a CPU with AVX-512-BF16 / AMX."""
    if device.startswith("cuda"):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return half_native(torch.bfloat16)


@functools.cache
def half_native(dtype: torch.dtype) -> bool:
    """Whether this CPU computes ``dtype`` (bfloat16 or float16) natively (AVX-512-BF16 / AMX, AVX512-FP16),
    as oneDNN sees it; where not, torch emulates it in float32 lane by lane, often slower than float32.
    Asked once per dtype (the CPU does not change)."""
    try:
        check = {torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported,
                 torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported}.get(dtype)
        return bool(check()) if check else False
    except (AttributeError, RuntimeError):
        return False


def emulates_half(t: torch.Tensor) -> bool:
    """Whether ``t`` is a bfloat16 / float16 tensor on a CPU that computes its type only by emulation: the
    one rule by which a 16-bit prompt's attention (ops/sdpa.py) and GELU (nn/feed_forward.py) run on float32
    copies, rounded back once (docs/inference.md has the figures)."""
    return t.device.type == "cpu" and t.dtype in (torch.bfloat16, torch.float16) and not half_native(t.dtype)


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


def machine_key(dtype: torch.dtype, device: str) -> str:
    """What a measured speed depends on: the processor, torch's version, the thread count, dtype and device."""
    if device.startswith("cuda"):
        chip = torch.cuda.get_device_name(torch.device(device))
    else:
        chip = cpu_info().model
    return f"{chip} | torch {torch.__version__} | {torch.get_num_threads()} threads | {dtype} | {device.split(':')[0]}"


def cached_matmul_peak_flops(dtype: torch.dtype, device: str, cache_dir: str | os.PathLike) -> float:
    """:func:`matmul_peak_flops`, measured once per :func:`machine_key` and kept in
    ``<cache_dir>/matmul_peak.json`` (delete the file to measure again): the measurement is not repeated every run."""
    from tformer.io import atomic_write_json

    path, key = Path(cache_dir) / "matmul_peak.json", machine_key(dtype, device)
    try:
        table = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        table = {}
    if not isinstance(table, dict) or not isinstance(table.get(key), (int, float)):
        table = table if isinstance(table, dict) else {}
        table[key] = matmul_peak_flops(dtype, device)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(path, table)
        except OSError:
            pass                                       # a read-only cache: measure again next time
    return float(table[key])


def _cpu_ticks() -> tuple[int, int]:
    with open("/proc/stat", encoding="ascii") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)          # idle + iowait
    return sum(fields[:8]) - idle, sum(fields[:8])                    # busy, total (no guest double count)


def busy_cores(seconds: float = 1.0) -> float:
    """Cores kept busy by other processes over the next ``seconds``, from /proc/stat while this
    process sleeps (the 1-minute load average lags by minutes); falls back to the load average."""
    try:
        b0, t0 = _cpu_ticks()
        time.sleep(seconds)
        b1, t1 = _cpu_ticks()
    except (OSError, ValueError, IndexError):
        return os.getloadavg()[0]
    return (b1 - b0) / max(t1 - t0, 1) * (os.cpu_count() or 1)


def available_cores() -> int:
    """The CPU cores this process may run on (its affinity mask), the bound for a ``threads`` setting."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def auto_threads(ranks: int = 1) -> int:
    """PyTorch's thread count, less the cores other processes keep busy right now; with ``ranks``
    processes sharing this machine (torchrun's local ranks), its cores divided by them (each gets
    cores // N, so N ranks do not oversubscribe).

    Intra-op threads that share a busy core wait on each other: on a 2-core machine with a load of
    4, two threads ran a tiny-model step 4x slower than one thread did.
    """
    cores = available_cores()
    default = _DEFAULT_THREADS if ranks == 1 else cores // ranks
    busy = round(busy_cores(0.5))
    return max(1, min(default, (cores - busy) // ranks))


def _own_ticks() -> int:
    """This process's CPU time, all its threads and the children it has waited for (a kernel build's
    compiler during a model's load), in /proc/stat's ticks: utime + stime + cutime + cstime of /proc/self/stat."""
    with open("/proc/self/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return sum(int(v) for v in fields[11:15])


class FreeCores:
    """The cores other processes leave free, measured while this process works (a model's load, say)
    instead of sleeping for it: from construction to :meth:`threads`, /proc/stat's busy ticks less this
    process's own. A browser or a ``yes`` on one of two cores makes it one: intra-op threads on a core
    that is not free wait out the other process's time slices at every parallel region (beside one ``yes`` on
    a 2-core machine, 2 threads decoded 1.9-7.8x slower than 1: benchmarks/results/quant/busy_threads-epyc.md)."""

    MIN_TICKS = 10          # a core's ticks (0.1 s): a shorter window says nothing (one tick of a neighbour
                            # would read as 1 / (window x cores) of the machine): keep the default

    def __init__(self):
        try:
            self._start = (*_cpu_ticks(), _own_ticks())
        except (OSError, ValueError, IndexError):
            self._start = None

    def threads(self, default: int) -> int:
        """``default`` less the cores others kept busy since construction (at least 1); ``default`` where
        /proc cannot tell (not Linux, or too short a window)."""
        if self._start is None:
            return default
        try:
            b1, t1 = _cpu_ticks()
            own1 = _own_ticks()
        except (OSError, ValueError, IndexError):
            return default
        b0, t0, own0 = self._start
        cores = os.cpu_count() or 1                    # /proc/stat's first line sums every core's ticks
        if t1 - t0 < self.MIN_TICKS * cores:
            return default
        busy = max(0, (b1 - b0) - (own1 - own0)) / (t1 - t0) * cores
        return max(1, min(default, available_cores() - round(busy)))


def available_memory() -> int:
    """Bytes of memory this process could still allocate: ``MemAvailable`` from /proc/meminfo (what
    the kernel can hand out without swapping), else the physical memory, else 2**62 (unknown)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 2**62


@functools.lru_cache(maxsize=None)
def _malloc_trim():
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):                 # not glibc (macOS, musl): nothing to hand back
        return None


def release_free_heap() -> None:
    """Hand the C heap's free pages back to the operating system (glibc's ``malloc_trim(0)``; nothing where
    the C library has none). glibc keeps the pages of freed tensors resident for reuse; a training step
    frees and re-allocates activations of many sizes, so its resident set grows past what is live."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
