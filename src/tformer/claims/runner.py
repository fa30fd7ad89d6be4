"""Run claims: a progress bar, a cache keyed by the claim's code and config, results.json and the report.

Cache key: SHA-256 of the claim's source file, the shared helpers (``base.py``, ``common.py``), the
size's config and the torch version. A hit reuses the measured values; the checks, rows and plot are
recomputed from them (they are cheap, and their code is in the key anyway). Code elsewhere in tformer
is not in the key: pass ``fresh=True`` (``--fresh``) after changing it.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import sys
import time
import traceback
from pathlib import Path

import torch
from tqdm.auto import tqdm

from tformer.errors import InputError
from tformer.io import atomic_write, atomic_write_json
from tformer.claims.base import Claim, verdict_of
from tformer.claims.common import figure_png
from tformer.claims.real import Unavailable
from tformer.claims.resume import Parts, scratch_root
from tformer.claims.registry import module_file
from tformer.machine import busy_cores, cpu_info

HERE = Path(__file__).resolve().parent


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tformer" / "claims"


def cache_key(claim: Claim, size: str) -> str:
    """Hash of the claim's code, the shared claim code, its config for ``size`` and torch's version."""
    h = hashlib.sha256()
    for path in (module_file(claim), HERE / "base.py", HERE / "common.py"):
        h.update(Path(path).read_bytes())
    h.update(json.dumps({"size": size, "config": claim.sizes[size], "torch": torch.__version__},
                        sort_keys=True).encode())
    return h.hexdigest()[:16]


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def writable_folder(path: Path, flag: str) -> None:
    """Make ``path`` (and its parents) a folder this process can write into, or raise ``InputError``
    in one sentence naming ``flag``."""
    for part in [path, *path.parents]:
        if part.exists() and not part.is_dir():
            raise InputError(f"{flag} {path}: {part} is a file, not a folder; pass a folder path.")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"{flag} {path}: cannot create it ({e.strerror}); pass a folder you can write to.") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise InputError(f"{flag} {path}: the folder is not writable; fix its permissions or pass another folder.")


class _Progress:
    """What a claim's ``run`` gets as ``progress``: ``progress(iterable, desc)`` wraps a loop in a nested bar;
    ``parts`` (or ``None``) stores finished parts for a resumed run (:mod:`tformer.claims.resume`)."""

    def __init__(self, parts: Parts | None = None):
        self.parts = parts

    def __call__(self, iterable, desc: str):
        return tqdm(iterable, desc=f"  {desc}", leave=False, position=1, dynamic_ncols=True)


def run_claim(claim: Claim, size: str, cache_dir: Path | None, fresh: bool = False) -> dict:
    """Run (or load from the cache) one claim; returns its entry of results.json, with ``png`` bytes."""
    key = cache_key(claim, size)
    path = cached_path(claim, size, cache_dir) if cache_dir else None
    cached = bool(path and path.exists() and not fresh)
    if cached:
        stored = json.loads(path.read_text(encoding="utf-8"))
    else:
        full = size == "full"                 # the load is sampled over a second: for the full size only
        busy_before = busy_cores(1.0) if full else None
        t0 = time.perf_counter()
        parts = Parts(path.with_suffix(".parts.json")) if path else None
        if parts is not None and fresh and parts.path.exists():
            parts.path.unlink()
            parts = Parts(parts.path)
        measured = claim.run(claim.sizes[size], _Progress(parts))
        seconds = time.perf_counter() - t0
        stored = {"measured": measured, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  "threads": torch.get_num_threads(), "load_average": round(os.getloadavg()[0], 1)}
        if full:
            stored.update(busy_cores_before=round(busy_before, 2), busy_cores_after=round(busy_cores(1.0), 2))
        if parts is not None and parts.reused:            # resumed: count the earlier sittings' parts too
            stored["resumed_parts"] = parts.reused
            seconds += parts.reused_seconds()
        stored["seconds"] = round(seconds, 2)
        if path:
            atomic_write_json(path, stored)
            if parts is not None and parts.path.exists():
                parts.path.unlink()
            if parts is not None and scratch_root(parts.path).exists():
                shutil.rmtree(scratch_root(parts.path))
    measured = numeric_order(stored["measured"])
    checks = claim.checks(measured)
    return {
        "name": claim.name, "title": claim.title, "sentence": claim.sentence, "source": claim.source,
        "published": [list(p) for p in claim.published], "notes": claim.notes, "size": size,
        "config": claim.sizes[size], "code_hash": key, "cached": cached,
        "seconds": stored["seconds"], "date": stored["date"], "resumed_parts": stored.get("resumed_parts", []),
        "machine": {k: stored[k] for k in ("threads", "busy_cores_before", "busy_cores_after", "load_average")
                    if k in stored},                     # how busy the machine was while this claim measured
        "checks": [{"what": c.what, "passed": bool(c.passed), "detail": c.detail} for c in checks],
        "verdict": verdict_of(checks),
        "rows": [list(r) for r in claim.rows(measured)],
        "measured": measured,
        "png": figure_png(claim.plot(measured)),
    }


def numeric_order(obj):
    """``obj`` with every dict whose keys are all integers written as strings (sequence lengths, positions)
    in numeric order. The cache and the parts file store JSON with sorted keys, so "1024" would come before
    "256" and a claim's rows and plot, which read its dicts in order, would list and draw them that way."""
    if isinstance(obj, dict):
        items = [(k, numeric_order(v)) for k, v in obj.items()]
        if items and all(isinstance(k, str) and k.lstrip("-").isdigit() for k, _ in items):
            items.sort(key=lambda kv: int(kv[0]))
        return dict(items)
    if isinstance(obj, list):
        return [numeric_order(v) for v in obj]
    return obj


def cached_path(claim: Claim, size: str, cache_dir: Path) -> Path:
    """Where ``claim``'s result at ``size`` is stored for its current code hash."""
    return cache_dir / f"{claim.name}-{size}-{cache_key(claim, size)}.json"


def run_claims(claims: list[Claim], size: str = "quick", out: str | os.PathLike = "claims-report",
               cache_dir: str | os.PathLike | None = None, fresh: bool = False, use_cache: bool = True,
               cached_only: bool = False) -> dict:
    """Run ``claims`` at ``size`` with a progress bar; write ``out/index.html``, ``out/results.json``
    and ``out/results.md``. Returns the results dict (without the PNG bytes).

    ``cached_only`` measures nothing: the report is assembled from the cache alone, and a claim
    without a cached result at its current code hash is listed with the verdict ``not run``. That
    is how a full run too long for one sitting is merged: run the claims one or a few at a time
    with the same ``cache_dir`` (each stores its own result), then once with ``cached_only``."""
    from tformer.claims.report import render_html, render_markdown

    out = Path(out)
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    writable_folder(out, "--out")                # before minutes of measuring, not after
    if use_cache:
        writable_folder(cache, "--cache-dir")
    busy_before = busy_cores(1.0)                  # cores other processes kept busy just before the run
    entries = []
    bar = tqdm(claims, desc=f"claims ({size})", unit="claim", dynamic_ncols=True)
    for claim in bar:
        bar.set_postfix_str(claim.name)
        if cached_only and not cached_path(claim, size, cache).exists():
            entries.append(_error_entry(claim, size, f"no cached {size} result for code hash {cache_key(claim, size)} "
                                        f"in {cache}; run `tformer claims run {claim.name}` first.", verdict="not run"))
            continue
        try:
            entries.append(run_claim(claim, size, cache if use_cache else None, fresh))
        except Unavailable as e:    # a real model that is not installed: say so, run the others
            print(f"{claim.name}: unavailable: {e}", file=sys.stderr)
            entries.append(_error_entry(claim, size, str(e), verdict="unavailable"))
        except Exception:  # a crashing claim is a bug: keep its traceback, report it, run the others
            trace = traceback.format_exc()
            print(trace, file=sys.stderr)
            entries.append(_error_entry(claim, size, trace))
    results = {
        "generated": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "size": size,
        "cpu": cpu_name(), "instruction_sets": list(cpu_info().instruction_sets), "cores": os.cpu_count(),
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "busy_cores_before": round(busy_before, 2), "busy_cores_after": round(busy_cores(1.0), 2),
        "load_average": round(os.getloadavg()[0], 1), "cached_only": cached_only,
        "claims": [{k: v for k, v in e.items() if k != "png"} for e in entries],
    }
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "results.json", results)
    _write_text(out / "index.html", render_html(results, [e["png"] for e in entries]))
    _write_text(out / "results.md", render_markdown(results))
    return results


def _error_entry(claim: Claim, size: str, trace: str, verdict: str = "error") -> dict:
    return {"name": claim.name, "title": claim.title, "sentence": claim.sentence, "source": claim.source,
            "published": [list(p) for p in claim.published], "notes": claim.notes, "size": size,
            "config": claim.sizes[size], "code_hash": cache_key(claim, size), "cached": False, "seconds": 0.0,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "checks": [], "verdict": verdict,
            "rows": [], "measured": {}, "error": trace, "png": None}


def _write_text(path: Path, text: str) -> None:
    def write(tmp: str) -> None:
        Path(tmp).write_text(text, encoding="utf-8")
    atomic_write(path, write)
