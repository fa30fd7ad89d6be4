"""Helpers shared by the benchmark scripts (``benchmarks/<topic>/*.py`` put ``benchmarks/`` on the
path with a two-line shim, then ``from common.record import Run``)."""
