"""Resuming a claim whose full run is longer than one sitting: its parts are stored as they finish.

A claim wraps each self-contained part of its experiment (one model trained, one sweep point) in
:func:`part`. When the runner has a cache, each finished part's (JSON-able) result is written at once to
``<cache>/<claim>-<size>-<code hash>.parts.json``; a run that is stopped (a time limit, a shared
machine's lock held for minutes only) and started again with the same code and config recomputes only
the parts not yet stored. The file goes when the whole result is cached. Without a cache (tests,
``use_cache=False``) :func:`part` just computes.

A part that resumes by itself from files (an IsoFLOP sweep's ``runs.json`` and checkpoints) takes
:func:`scratch_folder` instead: beside the parts file while the claim is unfinished (the runner
removes it with the parts file), a temporary folder without a cache.
"""

from __future__ import annotations

import json
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

from tformer.io import atomic_write_json


class Parts:
    """The stored parts of one claim's run, in ``path`` (a JSON object: part key -> result)."""

    def __init__(self, path: Path):
        self.path = path
        stored = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
        self.done: dict[str, Any] = stored.get("parts", {})
        self.seconds: dict[str, float] = stored.get("seconds", {})
        self.reused: list[str] = []

    def get(self, key: str, compute: Callable[[], Any]) -> Any:
        if key in self.done:
            self.reused.append(key)
            return self.done[key]
        t0 = time.perf_counter()
        value = json.loads(json.dumps(compute()))       # what a resumed run would read back, exactly
        self.done[key], self.seconds[key] = value, round(time.perf_counter() - t0, 2)
        atomic_write_json(self.path, {"parts": self.done, "seconds": self.seconds})
        return value

    def reused_seconds(self) -> float:
        """Time the earlier sittings spent on the parts this one read back."""
        return sum(self.seconds.get(k, 0.0) for k in self.reused)


def part(progress, key: str, compute: Callable[[], Any]) -> Any:
    """``compute()``, or its stored result when an earlier, stopped run of the same claim finished it.
    ``progress`` is the callable the runner passed to the claim's ``run`` (it carries the store)."""
    parts = getattr(progress, "parts", None)
    return parts.get(key, compute) if parts is not None else compute()


def scratch_root(parts_path: Path) -> Path:
    """``<claim>-<size>-<hash>.scratch`` beside ``<claim>-<size>-<hash>.parts.json``."""
    return parts_path.with_name(parts_path.name.removesuffix(".parts.json") + ".scratch")


@contextmanager
def scratch_folder(progress, name: str):
    """A folder for a part's own resumable files that outlives a stopped run (see the module docstring)."""
    parts = getattr(progress, "parts", None)
    if parts is None:
        with tempfile.TemporaryDirectory(prefix=f"tformer-claim-{name}-") as tmp:
            yield Path(tmp)
        return
    folder = scratch_root(parts.path) / name
    folder.mkdir(parents=True, exist_ok=True)
    yield folder
