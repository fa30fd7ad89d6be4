"""Counters, gauges and histograms in Prometheus' text format (no client library needed).

Everything is updated from the scheduler thread and the event loop; each update is one small
operation under one lock, and :meth:`Metrics.render` reads a consistent snapshot.
"""

from __future__ import annotations

import bisect
import threading
from collections import defaultdict

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class Metrics:
    """Named counters (with labels), gauges and histograms."""

    def __init__(self):
        self.lock = threading.Lock()
        self.counters: dict[tuple[str, tuple], float] = defaultdict(float)
        self.gauges: dict[str, float] = {}
        self.hists: dict[str, tuple[tuple, list[int], list[float]]] = {}   # buckets, counts, [sum, n]
        self.help: dict[str, tuple[str, str]] = {}

    def inc(self, name: str, value: float = 1.0, help: str = "", **labels) -> None:
        with self.lock:
            self.help.setdefault(name, ("counter", help))
            self.counters[(name, tuple(sorted(labels.items())))] += value

    def set(self, name: str, value: float, help: str = "") -> None:
        with self.lock:
            self.help.setdefault(name, ("gauge", help))
            self.gauges[name] = value

    def observe(self, name: str, value: float, buckets=LATENCY_BUCKETS, help: str = "") -> None:
        with self.lock:
            self.help.setdefault(name, ("histogram", help))
            b, counts, total = self.hists.setdefault(name, (tuple(buckets), [0] * (len(buckets) + 1), [0.0, 0]))
            counts[bisect.bisect_left(b, value)] += 1
            total[0] += value
            total[1] += 1

    def value(self, name: str, **labels) -> float:
        """A counter's or gauge's current value (tests and /health read these)."""
        with self.lock:
            if name in self.gauges:
                return self.gauges[name]
            if labels:
                return self.counters.get((name, tuple(sorted(labels.items()))), 0.0)
            return sum(v for (n, _), v in self.counters.items() if n == name)

    def render(self) -> str:
        lines = []
        with self.lock:
            for name, (kind, help) in sorted(self.help.items()):
                lines += [f"# HELP {name} {help}", f"# TYPE {name} {kind}"]
                if kind == "counter":
                    for (n, labels), v in sorted(self.counters.items()):
                        if n == name:
                            lab = ",".join(f'{k}="{v_}"' for k, v_ in labels)
                            lines.append(f"{name}{{{lab}}} {v:g}" if lab else f"{name} {v:g}")
                elif kind == "gauge":
                    lines.append(f"{name} {self.gauges[name]:g}")
                else:
                    b, counts, (s, n) = self.hists[name]
                    cum = 0
                    for edge, c in zip(list(b) + ["+Inf"], counts):
                        cum += c
                        lines.append(f'{name}_bucket{{le="{edge}"}} {cum}')
                    lines += [f"{name}_sum {s:g}", f"{name}_count {n}"]
        return "\n".join(lines) + "\n"
