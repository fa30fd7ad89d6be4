"""Kill -9 at a random moment of a first start, then start again: the next start must neither hang nor
fail (issue 49, "Done when"). A script, run by hand (it takes tens of minutes; not collected by pytest):

    flock -s /tmp/tformer-bench.lock env PYTHONPATH=src python tests/kill_starts.py [--trials 10] [--fresh 1]

For each of ``chat``, ``train``, ``generate`` and ``serve``, ``--trials`` times: a new ``TFORMER_CACHE``
(the first ``--fresh`` trials truly empty, so the kill lands in a kernel build and the next start builds
every kernel; the others a copy of the kernels built once up front, with one library's ``.so`` deleted at
random so that a relink is under way, plus nothing else), the command started and killed (its whole
process group, SIGKILL) after a random delay within its start time (measured once per command on a
prebuilt cache; 0.2 to 25 s, inside the kernel builds, for the fresh trials), then the same command
started again in the same cache, which must exit 0 (``serve``: answer ``/health``) within ``--limit`` s.
Prints one line per trial and a summary; exits 1 if any next start hung or failed.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPUS = "To be, or not to be, that is the question.\n" * 200


def command(name: str, work: Path, port: int) -> list[str]:
    tf = [sys.executable, "-m", "tformer"]
    if name == "chat":
        return tf + ["chat", "--prompt", "Hi", "--max-new-tokens", "4", "--seed", "0"]
    if name == "generate":
        return tf + ["generate", "--model", "smollm2", "--prompt", "Hi", "--max-new-tokens", "4", "--seed", "0"]
    if name == "train":
        return tf + ["train", "--data", str(work / "corpus.txt"), "--out", str(work / f"run-{time.monotonic_ns()}"),
                     "--set", "n_layers=1", "--set", "max_steps=5"]
    return tf + ["serve", "--model", "smollm2", "--port", str(port)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


def start(name: str, work: Path, env: dict, port: int, log) -> subprocess.Popen:
    return subprocess.Popen(command(name, work, port), cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


def kill(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()


def next_start(name: str, work: Path, env: dict, limit: float, log) -> tuple[bool, str, float]:
    port = free_port()
    t0 = time.monotonic()
    p = start(name, work, env, port, log)
    try:
        while time.monotonic() - t0 < limit:
            if name == "serve" and healthy(port):
                return True, "healthy", time.monotonic() - t0
            if p.poll() is not None:
                ok = p.returncode == 0 and name != "serve"
                return ok, f"exit {p.returncode}", time.monotonic() - t0
            time.sleep(0.2)
        return False, f"HUNG (> {limit:.0f} s)", time.monotonic() - t0
    finally:
        kill(p)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--fresh", type=int, default=1, help="trials per command with a truly empty cache")
    ap.add_argument("--limit", type=float, default=900.0, help="seconds a next start may take")
    ap.add_argument("--commands", default="chat,train,generate,serve")
    ap.add_argument("--seed-cache", help="a cache with the kernels built (default: built here first)")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    rng = random.Random(int(os.environ.get("KILL_SEED", "49")))
    top = Path(tempfile.mkdtemp(prefix="tformer-kill-"))
    base_env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PYTHONUNBUFFERED": "1"}
    seed = Path(args.seed_cache) if args.seed_cache else top / "seed"
    if not args.seed_cache:
        subprocess.run([sys.executable, "-m", "tformer", "kernels"], env={**base_env, "TFORMER_CACHE": str(seed)},
                       check=True)
    libraries = sorted(seed.glob("*/tformer_*.so"))
    failures, lines = 0, []
    for name in args.commands.split(","):
        # how long this command's start takes on a prebuilt cache: the kills land anywhere inside it
        work = top / f"{name}-calibrate"
        work.mkdir(parents=True)
        (work / "corpus.txt").write_text(CORPUS, encoding="utf-8")
        for lib in libraries:
            shutil.copytree(lib.parent, work / "cache" / lib.parent.name)
        with open(work / "next.log", "wb") as log:
            ok, how, window = next_start(name, work, {**base_env, "TFORMER_CACHE": str(work / "cache")}, args.limit,
                                         log)
        print(f"{name:<9} a start on a prebuilt cache: {how} in {window:.1f} s", flush=True)
        shutil.rmtree(work, ignore_errors=True)
        for trial in range(args.trials):
            work = top / f"{name}-{trial}"
            cache = work / "cache"
            work.mkdir(parents=True)
            (work / "corpus.txt").write_text(CORPUS, encoding="utf-8")
            fresh = trial < args.fresh
            if not fresh:
                for lib in libraries:
                    shutil.copytree(lib.parent, cache / lib.parent.name)
                gone = rng.choice(libraries) if libraries else None
                if gone is not None:
                    (cache / gone.parent.name / gone.name).unlink()
            else:
                cache.mkdir()
            env = {**base_env, "TFORMER_CACHE": str(cache)}
            delay = rng.uniform(0.2, 25.0) if fresh else rng.uniform(0.1, 0.95 * window)   # fresh: in the builds
            with open(work / "first.log", "wb") as log:
                p = start(name, work, env, free_port(), log)
                t0 = time.monotonic()
                while time.monotonic() - t0 < delay and p.poll() is None:
                    time.sleep(0.05)
                finished = p.poll() is not None
                kill(p)
            with open(work / "next.log", "wb") as log:
                ok, how, took = next_start(name, work, env, args.limit, log)
            failures += not ok
            line = (f"{name:<9} trial {trial:>2} {'fresh ' if fresh else 'seeded'} killed at {delay:6.1f} s"
                    f"{' (had ended)' if finished else ''}; next start: {how} in {took:6.1f} s -> "
                    f"{'ok' if ok else 'FAIL'}")
            print(line, flush=True)
            lines.append(line)
            if not ok:
                print((work / "next.log").read_text(errors="replace")[-1500:], flush=True)
            elif not args.keep:
                shutil.rmtree(work, ignore_errors=True)
    print(f"{len(lines) - failures} of {len(lines)} next starts ok; {failures} hung or failed", flush=True)
    if not args.keep and not failures:
        shutil.rmtree(top, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
