"""Decode weights on 2 MB pages: one arena, filled in the order a decode step reads it.

A decode step streams every weight once (GPT-2 124M in float32: 494 MB a token). On 4 KB pages that
is ~120,000 address translations a token, far more than a core's second-level TLB holds (Zen 3:
2,048 entries, 8 MB of 4 KB pages), so the stream also walks page tables as it goes; on 2 MB pages it
is ~250. Linux backs anonymous memory with 2 MB pages ("transparent huge pages") everywhere when
``/sys/kernel/mm/transparent_hugepage/enabled`` says ``always``, but with ``madvise`` (a common default,
and this project's EPYC guest) only in ranges advised ``MADV_HUGEPAGE``, which torch's allocator does
only when ``THP_MEM_ALLOC_ENABLE=1`` was set before it started. llama.cpp reads its weights from the
mapped file, whose page cache the kernel may also hold in large pages.

:class:`Arena` is one private anonymous mapping, advised before it is touched, its start on a 2 MB
boundary; :meth:`Arena.put` copies a tensor into its next 4 KB-aligned slot. Measured on the 2-core
EPYC (AVX2), GPT-2 124M's 49 decode matrices through ``tformer_gemv::gemv``, one copy in an arena and
one as torch allocated it, alternated 40 times in one process: 0.90-0.93x the time in float32,
0.88-0.92x in float16, 0.91x in bfloat16 (median of per-round ratios, 2 to 3 runs each;
``benchmarks/quant/huge_pages.py`` measures the whole decode). Where the mapping cannot be advised (not
Linux) or ``TFORMER_HUGE_PAGES=0`` (A/B runs), :func:`arena` gives ``None`` and the weights stay
where they are.
"""

from __future__ import annotations

import mmap
import os

import torch

Tensor = torch.Tensor
HUGE = 2 << 20          # bytes in a 2 MB page (x86-64's PMD size)
ALIGN = 4096            # each tensor's first byte: a 4 KB page (more than any SIMD load needs)
SWITCH = "TFORMER_HUGE_PAGES"
MIN_BYTES = HUGE        # less than one 2 MB page in all: no arena (the tests lower it to run tiny models through one)


def enabled() -> bool:
    """Whether weights go into arenas here: Linux's advice exists and ``TFORMER_HUGE_PAGES`` is not 0."""
    return hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get(SWITCH, "1") != "0"


def _slot(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class Arena:
    """``nbytes`` of fresh memory advised for 2 MB pages, filled front to back by :meth:`put`.

    The mapping lives as long as any tensor made from it (``torch.frombuffer`` holds the mmap).
    Raises ``OSError`` where the system refuses the mapping (out of address space or memory).
    """

    def __init__(self, nbytes: int):
        # private, not shared: shared anonymous memory is shmem, which follows another THP setting
        self._map = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._map.madvise(mmap.MADV_HUGEPAGE)          # before the first touch: the faults then take 2 MB pages
        raw = torch.frombuffer(self._map, dtype=torch.uint8)
        start = (-raw.data_ptr()) % HUGE
        self.bytes = raw[start:start + nbytes]                                   # (nbytes,) uint8
        self.used = 0

    def put(self, t: Tensor) -> Tensor:
        """A contiguous copy of ``t`` (same shape and dtype) in the next free slot.

        Raises:
            ValueError: ``t`` does not fit in what is left (the arena was sized for other tensors).
        """
        n = t.numel() * t.element_size()
        if self.used + n > self.bytes.numel():
            raise ValueError(f"{n} bytes do not fit in the arena's {self.bytes.numel() - self.used} left")
        out = self.bytes[self.used:self.used + n].view(t.dtype).view(t.shape)
        out.copy_(t)
        self.used += _slot(n)
        return out


def arena(tensors: list[Tensor]) -> Arena | None:
    """An arena that holds ``tensors`` side by side, or ``None`` where there is no point: huge pages
    switched off or not available, or less than one 2 MB page in all."""
    total = sum(_slot(t.numel() * t.element_size()) for t in tensors)
    if not enabled() or total < MIN_BYTES:
        return None
    return Arena(total)


def huge_bytes(t: Tensor) -> int | None:
    """Bytes of the mapping that holds ``t``'s first element that Linux backs with 2 MB pages
    (``AnonHugePages`` in ``/proc/self/smaps``), or ``None`` where that file is not there."""
    try:
        with open("/proc/self/smaps") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    addr, inside = t.data_ptr(), False
    for line in lines:
        head = line.split()[0] if line else ""
        if "-" in head and not head.endswith(":"):                     # a mapping's first line: "start-end perms ..."
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    return None
