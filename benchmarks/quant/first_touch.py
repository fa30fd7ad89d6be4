"""What the first write into fresh memory costs, with and without asking for huge pages first: whether the
tile arenas (src/tformer/quant/qgemv.cpp, ``arena_zeros``) should ask before their first write.

Per round, 128 MB of anonymous memory is mapped fresh and filled twice (``memset``): the first fill
pays the page faults (and, after ``madvise(MADV_HUGEPAGE)``, the kernel's search for free 2 MB pages),
the second is the bandwidth. Rounds alternate the two kinds. Criterion, stated before the run: asking
first is the right default only if its first fill is not slower than the plain one's in the median.

    flock /tmp/tformer-bench.lock env PYTHONPATH=src .venv/bin/python benchmarks/quant/first_touch.py --rounds 6

Writes benchmarks/results/quant/first_touch[-TAG].md.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # benchmarks/, for common/
from common.record import Run  # noqa: E402

SIZE, HUGE = 128 << 20, 2 << 20
PROT_RW, MAP_PRIVATE_ANON, MADV_HUGEPAGE = 0x3, 0x22, 14


def fill_twice(libc, ask_first: bool) -> tuple[float, float]:
    """(seconds of the first fill, of the second) of a fresh 128 MB mapping, huge pages asked for first or not."""
    p = libc.mmap(None, SIZE + HUGE, PROT_RW, MAP_PRIVATE_ANON, -1, 0)
    base = (p + HUGE - 1) // HUGE * HUGE
    if ask_first:
        libc.madvise(base, SIZE, MADV_HUGEPAGE)
    times = []
    for value in (0, 1):
        t = time.perf_counter()
        libc.memset(base, value, SIZE)
        times.append(time.perf_counter() - t)
    libc.munmap(p, SIZE + HUGE)
    return times[0], times[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    run = Run()
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    rows = {"plain": [], "huge pages asked first": []}
    for r in range(args.rounds):
        for name in (list(rows) if r % 2 == 0 else list(reversed(rows))):
            rows[name].append(fill_twice(libc, name != "plain"))
    thp = Path("/sys/kernel/mm/transparent_hugepage")
    policy = " / ".join(f"{k}: {(thp / k).read_text().strip()}" for k in ("enabled", "defrag") if (thp / k).exists())
    lines = ["# First writes into fresh memory, 128 MB, with and without huge pages asked for first", "",
             f"{args.rounds} alternated rounds; transparent huge pages {policy or 'not found'}.", "",
             "| mapping | first fill ms (median) | per round | second fill ms (median) |", "|---|---:|---|---:|"]
    for name, xs in rows.items():
        lines.append(f"| {name} | {statistics.median(a for a, _ in xs) * 1e3:.1f} | "
                     f"{' / '.join(f'{a * 1e3:.0f}' for a, _ in xs)} | {statistics.median(b for _, b in xs) * 1e3:.1f} |")
    run.write_result("quant", "first_touch", args.tag, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
