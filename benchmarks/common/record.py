"""What every benchmark result file records about the run that wrote it.

A figure without its circumstances cannot be compared with the next one. :class:`Run` is made when
a script starts and notes the date, the exact command, and how many cores other processes kept busy
(``tformer.machine.busy_cores``: CPU time from /proc/stat while this process sleeps, because the
1-minute load average lags by minutes); when the result is written it adds the commit (``git
rev-parse``, and whether the tree had uncommitted changes), the CPU's model name and instruction sets
(``tformer.machine.cpu_info``), torch's version and thread count, and the busy cores again.

``run.write(path, text)`` writes a markdown (or any text) result with that record as a block after
its title; ``run.write_json(path, obj)`` adds the same record as a dict under the key ``"recorded"``;
``run.write_result(topic, name, tag, text, data)`` does both under the results folder's usual names,
``<topic>/<name>[-<tag>].md`` and ``.json``. ``RECORD_MARK`` opens the block, so the index test can tell a recorded file from
one written before the header existed.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import torch

from tformer.io import atomic_write
from tformer.machine import busy_cores, cpu_info

ROOT = Path(__file__).resolve().parents[2]          # the repository
RESULTS = ROOT / "benchmarks" / "results"
RECORD_MARK = "<!-- recorded by benchmarks/common/record.py -->"
BUSY_CORES = 0.3      # more than this much of a core used by others: the figures are noisy, and the record says so
# Variables that change what a run measures: threads, the kernels chosen, and the instruction sets the
# libraries may use (the AVX2 holds that emulate an AVX2-only CPU on a wider one); PYTHONPATH for what it
# puts before src (e.g. a llama.cpp built for AVX2 only, benchmarks/common/llama_cpp_avx2.sh).
ENV_THAT_MATTERS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS", "TFORMER_DECODE_KERNEL",
                    "TFORMER_QGEMV_PATH", "TFORMER_GEMV_PATH", "TFORMER_NO_EXTENSION", "ONEDNN_MAX_CPU_ISA",
                    "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "OPENBLAS_CORETYPE", "OPENBLAS_NUM_THREADS",
                    "PYTHONPATH")


def results_dir(topic: str) -> Path:
    """``benchmarks/results/<topic>/``, created if missing."""
    path = RESULTS / topic
    path.mkdir(parents=True, exist_ok=True)
    return path


def result_name(name: str, tag: str = "") -> str:
    """A result file's name without its suffix: ``name``, or ``name-tag`` when a run was given a ``--tag``."""
    return name + (f"-{tag}" if tag else "")


def load_note(cores: float) -> str:
    """One phrase for a report: ``"0.02 of 2 cores busy with other work"`` plus a warning if busy."""
    text = f"{cores:.2f} of {os.cpu_count()} cores busy with other work (measured over 1 s)"
    return text + (" -- WARNING: the machine was busy; figures are noisy" if cores > BUSY_CORES else "")


def commit() -> str:
    """``git rev-parse HEAD`` of the repository, with ``+ uncommitted changes`` when tracked files differ."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
    try:
        head = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown (git is not available)"
    return (head or "unknown (not a git checkout)") + (" + uncommitted changes" if dirty else "")


def command(argv: list[str] | None = None) -> str:
    """The command line that reproduces this run, from the repository root: the environment variables
    that change a timing, ``python``, the script relative to the root, and the arguments as given."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]).resolve() if argv else Path("?")
    try:
        script = script.relative_to(ROOT)
    except ValueError:
        pass
    env = [f"{k}={shlex.quote(os.environ[k])}" for k in ENV_THAT_MATTERS if k in os.environ and k != "PYTHONPATH"]
    src = str(ROOT / "src")
    before = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
              if p and Path(p).resolve() != Path(src).resolve() and p != "src"]
    path = os.pathsep.join([*before, "src"])                 # what came before the repository's src, then src
    return " ".join(env + [f"PYTHONPATH={shlex.quote(path)}", "python", shlex.quote(str(script))]
                    + [shlex.quote(a) for a in argv[1:]])


class Run:
    """One benchmark invocation: made at the start (notes the date, command and busy cores before),
    read when a result is written (adds commit, CPU, torch, threads and busy cores after).

    Args:
        measure_load: sample the busy cores now (1 s); a script that already measured it passes
            ``busy_before`` instead.
        busy_before: cores busy with other work at the start, when the script measured it itself.
    """

    def __init__(self, measure_load: bool = True, busy_before: float | None = None, argv: list[str] | None = None):
        self.started = dt.datetime.now(dt.timezone.utc)
        self.command = command(argv)
        self.busy_before = busy_before if busy_before is not None else (busy_cores() if measure_load else None)
        self.busy_after: float | None = None

    def finish(self, busy_after: float | None = None) -> None:
        """Fix the busy cores at the end (measured now unless given); until then every write measures
        them afresh (1 s), so a result written part-way records the load up to that point."""
        self.busy_after = busy_after if busy_after is not None else busy_cores()

    def facts(self) -> dict:
        """The record as a dict (JSON results keep it under ``"recorded"``)."""
        after = self.busy_after if self.busy_after is not None else busy_cores()    # now, unless finish() fixed it
        cpu = cpu_info()
        return {"date": self.started.strftime("%Y-%m-%d %H:%M UTC"), "commit": commit(), "cpu": cpu.model,
                "instruction_sets": list(cpu.instruction_sets), "cores": os.cpu_count(),
                "torch": torch.__version__, "threads": torch.get_num_threads(),
                "busy_cores_before": None if self.busy_before is None else round(self.busy_before, 2),
                "busy_cores_after": round(after, 2), "command": self.command}

    def header(self) -> str:
        """The record as a markdown block (starts with :data:`RECORD_MARK`)."""
        f = self.facts()
        before = "not measured" if f["busy_cores_before"] is None else load_note(f["busy_cores_before"])
        return "\n".join([
            RECORD_MARK,
            f"- Date: {f['date']}; commit `{f['commit']}`",
            f"- CPU: {f['cpu']} ({', '.join(f['instruction_sets']) or 'no AVX2'}), {f['cores']} cores; "
            f"torch {f['torch']}, {f['threads']} threads",
            f"- Other work on the machine: before, {before}; after, {load_note(f['busy_cores_after'])}",
            f"- Reproduce: `{f['command']}`",
        ]) + "\n"

    def write(self, path: str | os.PathLike, text: str) -> Path:
        """Write ``text`` to ``path`` atomically with :meth:`header` after its first line when that
        line is a markdown title (before everything otherwise)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        first, sep, rest = text.partition("\n")
        body = (first + "\n\n" + self.header() + "\n" + rest.lstrip("\n")) if first.startswith("#") and sep \
            else self.header() + "\n" + text
        atomic_write(path, lambda tmp: Path(tmp).write_text(body if body.endswith("\n") else body + "\n",
                                                            encoding="utf-8"))
        return path

    def write_json(self, path: str | os.PathLike, obj: dict, indent: int | None = 1) -> Path:
        """Write the dict ``obj`` as JSON atomically, with :meth:`facts` under ``"recorded"``."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps({**obj, "recorded": self.facts()}, indent=indent) + "\n"
        atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
        return path

    def write_result(self, topic: str, name: str, tag: str, text: str, data: dict | None = None) -> Path:
        """Write ``text`` to ``benchmarks/results/<topic>/<name>[-<tag>].md`` (:meth:`write`) and, when
        ``data`` is given, ``data`` to the same name's ``.json`` (:meth:`write_json`); returns the markdown's
        path. The suffix is appended, never swapped in: names may hold dots (``qwen2.5``)."""
        stem, folder = result_name(name, tag), results_dir(topic)
        path = self.write(folder / f"{stem}.md", text)
        if data is not None:
            self.write_json(folder / f"{stem}.json", data)
        return path
