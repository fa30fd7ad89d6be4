"""A killed kernel build never blocks the next one, and a damaged built library is built again.

torch's ``cpp_extension.load`` takes a lock *file* in the build folder; a build killed while it held it
(kill -9, the OOM killer, a test's timeout) used to leave that file, and every later process waited on
it for ever, printing nothing (issue 49, item 1). A library truncated on disk died with "Bus error".
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tformer
from tformer.extensions import build_lock, check_library, find_ninja

SRC = str(Path(tformer.__file__).resolve().parents[1])

TINY = """
#include <torch/library.h>
int64_t plus_one(int64_t x) { return x + 1; }
TORCH_LIBRARY(tformer_locktest, m) { m.def("plus_one", plus_one); }
"""

LOAD = """
import sys
from pathlib import Path
from tformer.extensions import compile_library
op = compile_library("tformer_locktest", [Path(sys.argv[1])], [], "a test library")
print("answer", op.plus_one(41), flush=True)
"""

HOLD = """
import sys, time
from pathlib import Path
from tformer.extensions import build_lock
folder = Path(sys.argv[1])
with build_lock(folder, "a fake library"):
    (folder / "lock").touch()                 # what cpp_extension creates while it builds
    print("holding", flush=True)
    time.sleep(600)
"""


def env_for(cache: Path) -> dict:
    return {**os.environ, "TFORMER_CACHE": str(cache), "PYTHONPATH": SRC, "TFORMER_NO_EXTENSION": ""}


def test_a_build_killed_while_holding_the_lock_does_not_block_the_next(tmp_path):
    folder = tmp_path / "lib-0123"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], env=env_for(tmp_path), text=True,
                              stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        os.killpg(holder.pid, signal.SIGKILL)
    finally:
        holder.kill()
        holder.wait()
    assert (folder / "lock").exists()                  # torch's stale lock file, as a killed build leaves it
    start = time.monotonic()
    with build_lock(folder, "a fake library"):
        assert not (folder / "lock").exists()          # cleared under the live lock
    assert time.monotonic() - start < 5


def test_torch_s_lock_is_kept_while_a_process_works_in_the_folder(tmp_path):
    """An older tformer (no flock) building there: its lock file is waited for, not removed under it."""
    folder = tmp_path / "lib-89ab"
    folder.mkdir()
    (folder / "lock").touch()
    worker = subprocess.Popen(["sleep", "4"], cwd=folder)          # as ninja and the compiler run
    try:
        start = time.monotonic()
        with build_lock(folder, "a fake library"):
            assert worker.poll() is not None                         # waited for the worker to end
            assert not (folder / "lock").exists()
        assert time.monotonic() - start >= 4
    finally:
        worker.kill()
        worker.wait()


def test_a_second_builder_waits_for_a_live_one_and_says_so(tmp_path, capfd):
    import threading

    folder = tmp_path / "lib-4567"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], env=env_for(tmp_path), text=True,
                              stdout=subprocess.PIPE, start_new_session=True)
    got = threading.Event()
    try:
        assert holder.stdout.readline().strip() == "holding"

        def take():
            with build_lock(folder, "a fake library"):
                got.set()

        t = threading.Thread(target=take, daemon=True)
        t.start()
        time.sleep(1.0)
        assert not got.is_set()                         # a live holder is waited for, never broken
        holder.kill()
        t.join(30)
        assert got.is_set()
    finally:
        holder.kill()
        holder.wait()
    assert "waiting for another process that is building a fake library" in capfd.readouterr().err


def test_a_truncated_library_is_detected_and_deleted(tmp_path):
    import torch

    whole = Path(torch.__file__).parent / "lib" / "libc10.so"               # any real shared library
    lib = tmp_path / "x.so"
    lib.write_bytes(whole.read_bytes())
    assert check_library(lib) is True and lib.exists()
    for cut in (whole.stat().st_size - 1, whole.stat().st_size // 2, 100, 0):
        lib.write_bytes(whole.read_bytes()[:cut])
        assert check_library(lib) is False and not lib.exists(), cut
    assert check_library(lib) is True                                          # none there: nothing to do


def can_build() -> bool:
    import shutil

    return shutil.which(os.environ.get("CXX", "c++")) is not None and find_ninja() is not None \
        and not os.environ.get("TFORMER_NO_EXTENSION")


@pytest.mark.skipif(not can_build(), reason="no C++ compiler or ninja here")
def test_real_build_killed_midway_then_truncated_library_both_rebuild(tmp_path):
    """A real (tiny) library through ``compile_library``: kill -9 its build while torch's lock file exists,
    then the next load builds it (on e6cb2db it waited for ever); truncate the built ``.so``, and the
    next load builds it again (on e6cb2db: an error or "Bus error")."""
    source = tmp_path / "locktest.cpp"
    source.write_text(TINY, encoding="utf-8")
    cache = tmp_path / "cache"
    first = subprocess.Popen([sys.executable, "-c", LOAD, str(source)], env=env_for(cache),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not list(cache.glob("locktest-*/lock")) and time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.05)
        assert list(cache.glob("locktest-*/lock")), "the first build never took torch's lock"
        os.killpg(first.pid, signal.SIGKILL)           # the build and its compiler, mid-build
    finally:
        first.kill()
        first.wait()
    assert list(cache.glob("locktest-*/lock"))          # the stale lock file is there

    def load():
        return subprocess.run([sys.executable, "-c", LOAD, str(source)], env=env_for(cache), capture_output=True,
                              text=True, timeout=300)

    second = load()
    assert "answer 42" in second.stdout, second.stderr[-2000:]
    (library,) = cache.glob("locktest-*/tformer_locktest.so")
    with open(library, "r+b") as f:
        f.truncate(library.stat().st_size // 2)
    third = load()
    assert third.returncode == 0 and "answer 42" in third.stdout, (third.returncode, third.stderr[-2000:])
    assert "damaged" in third.stderr and check_library(library)
