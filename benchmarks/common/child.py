"""One configuration of a memory benchmark run alone in its own process: its JSON result (the last line it
prints) and its peak memory (the child's max RSS from ``os.wait4``, so nothing of the parent is counted)."""

from __future__ import annotations

import json
import os
import subprocess


def measured_child(argv: list[str], what: str) -> tuple[dict, float]:
    """``(the JSON object argv printed last, peak RSS in MB)``; ``what`` names the configuration in the
    one-line failure."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise SystemExit(f"the {what} worker failed (status {status})")
    return json.loads(out.decode().splitlines()[-1]), usage.ru_maxrss / 1024


# Each worker under the shared machine's benchmark gate and exclusive lock (``--lock-each``): one lock hold
# per configuration, for runs whose configurations together would hold it too long.
LOCK_EACH = ["flock", "/tmp/tformer-bench.gate", "flock", "/tmp/tformer-bench.lock"]


def worker_rows(script: str, args, keys: tuple[str, ...], configs: list[tuple[str, str]],
                names: tuple[str, str], prefix: list[str] | None = None) -> list[dict]:
    """Run ``script --worker X Y --key value ...`` (``keys`` of ``args``) alone for each ``(X, Y)`` of
    ``configs``, one after another: a row ``{names[0]: X, names[1]: Y, **its result, "peak_rss_mb"}`` each.
    ``prefix`` (e.g. :data:`LOCK_EACH`) goes before each worker's command; ``flock`` waits for its child, so
    the peak measured (``os.wait4``) is still the worker's."""
    import sys

    rows = []
    for x, y in configs:
        argv = list(prefix or []) + [sys.executable, script, "--worker", x, y] + \
               [v for k in keys for v in (f"--{k}", str(getattr(args, k)))]
        res, peak = measured_child(argv, f"{names[0]}={x} {names[1]}={y}")
        rows.append({names[0]: x, names[1]: y, **res, "peak_rss_mb": peak})
        print(rows[-1], flush=True)
    return rows


def memory_cells(r: dict, ref: dict) -> str:
    """A row's cells ``trained | RSS once built | peak RSS | peak / ref's | s/step | s/step / ref's | losses |``."""
    import statistics

    t, t0 = statistics.median(r["times"]), statistics.median(ref["times"])
    return (f"{r['trainable']:,} | {r['rss_built_mb']:,.0f} | {r['peak_rss_mb']:,.0f} | "
            f"{r['peak_rss_mb'] / ref['peak_rss_mb']:.2f}x | {t:.2f} | {t / t0:.2f}x | "
            f"{', '.join(f'{v:.4f}' for v in r['losses'])} |")


def timed_steps(loop, lr: float, warmup: int, steps: int, first: int = 0) -> dict:
    """Inside a worker: ``warmup`` + ``steps`` steps of ``loop._train_step(lr)``; the RSS before them (the model
    built), the timed steps' seconds, every loss, and the trained parameter count; ``first`` steps already run
    (by the caller) count as warm-up."""
    import resource
    import time

    built = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    times, losses = [], []
    for i in range(first, warmup + steps):
        t0 = time.perf_counter()
        loop.step = i
        losses.append(loop._train_step(lr))
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return {"rss_built_mb": built, "times": times, "losses": losses,
            "trainable": sum(p.numel() for p in loop.model.parameters() if p.requires_grad)}
