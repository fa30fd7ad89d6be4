"""Which bytes are a mapped file's pages, which may be handed back once copied: a GGUF's Q8_0 / Q4_0 /
Q4_1 matrices are copied into interleaved tiles (:func:`tformer.quant.qgemv.tiles`), after which the
products read only the tiles, yet the file's pages the copy read would stay counted in the process's
memory: the weights twice.

A GGUF is mapped copy-on-write and never written (:class:`tformer.interop.gguf_reader.GGUFFile`), so
``madvise(MADV_DONTNEED)`` on its pages only unmaps them: the page cache keeps the file, and a later
read (a checkpoint check, dequantisation, export, a tied embedding's row) maps the page again with the
same bytes. On anonymous memory the same call would zero it, so the repack releases only bytes
:func:`mapped` vouches for: inside a mapping :func:`register` recorded and that is still open.
"""

from __future__ import annotations

import mmap
import weakref

import torch

# (first address, end address, the mmap object) per registered file mapping, weakly: a closed map is skipped
_MAPPED: list[tuple[int, int, "weakref.ref"]] = []


def register(start: int, length: int, owner: mmap.mmap) -> None:
    """Record a file mapping of ``length`` bytes at address ``start`` (the first byte of the mmap ``owner``,
    its owner; mapped copy-on-write and never written: see the module docstring)."""
    _MAPPED[:] = [m for m in _MAPPED if m[2]() is not None]
    _MAPPED.append((start, start + length, weakref.ref(owner)))


def _mapping(t: torch.Tensor) -> tuple[mmap.mmap, int, int] | None:
    """The open registered mapping that holds all of ``t``'s bytes, and their offsets ``[begin, end)`` in it."""
    if t.device.type != "cpu" or not t.is_contiguous():
        return None
    begin = t.data_ptr()
    end = begin + t.numel() * t.element_size()
    for start, stop, ref in _MAPPED:
        owner = ref()
        if owner is not None and not owner.closed and start <= begin and end <= stop:
            return owner, begin - start, end - start
    return None


def mapped(t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes lie wholly inside a registered file mapping that is still open."""
    return _mapping(t) is not None


def release(t: torch.Tensor) -> bool:
    """Hand back the whole pages of ``t``'s bytes (``madvise(MADV_DONTNEED)``; the pages shared with a
    neighbour at either end stay) where :func:`mapped` vouches for them; whether it did."""
    found = _mapping(t)
    if found is None:
        return False
    owner, begin, end = found
    first = -(-begin // mmap.PAGESIZE) * mmap.PAGESIZE                # whole pages inside [begin, end)
    last = end // mmap.PAGESIZE * mmap.PAGESIZE
    if last > first:
        owner.madvise(mmap.MADV_DONTNEED, first, last - first)
    return True
