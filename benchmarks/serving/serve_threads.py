"""Why `tformer serve` decoded at about half the in-process rate: a second thread running torch work.

SmolLM2-135M-Instruct, the serving pool's decode step at batch 1 (300-token rows, 40 steps per
measurement, 2 torch threads), in ONE process per precision: on the main thread, then on a second
(persistent) thread, as the server's scheduler thread is, then on the main thread again. Each OS
thread that runs an OpenMP parallel region gets its own team; with more OpenMP workers than cores
libgomp throttles its spin-waiting between regions. Criterion, set before the run: if the second
thread's rate and the main thread's rate afterwards are both under 0.7x the first main-thread rate,
the server's 1-stream gap is this, and the fix is to run all torch work on one thread.

    /tmp/w3/cpulock bench env PYTHONPATH=src python benchmarks/serving/serve_threads.py

Writes benchmarks/results/serving/serve_threads.md.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # benchmarks/, for common/
from common.record import Run, results_dir  # noqa: E402


def child(dtype: str) -> None:
    import torch
    torch.set_num_threads(2)
    from tformer.inference import open_model
    from tformer.serve.pool import KVPool

    model = open_model("smollm2", dtype).model
    pool = KVPool(model, 4, 1024)
    prompt = list(range(100, 400))

    def rate(n: int = 40) -> float:
        t = pool.prefill([0], [prompt]).argmax(-1)
        start = time.perf_counter()
        for i in range(n):
            t = pool.decode(t, len(prompt) + 1 + i).argmax(-1)
            t.tolist()
        pool.release(0)
        return n / (time.perf_counter() - start)

    jobs, results = queue.Queue(), queue.Queue()

    def serve_jobs() -> None:                     # one thread that lives on, as the server's scheduler does
        while True:
            results.put(jobs.get()())
    threading.Thread(target=serve_jobs, daemon=True).start()

    def other(fn):
        jobs.put(fn)
        return results.get()
    out = {"main first": [rate(), rate()], "second thread": [other(rate), other(rate)],
           "main after": [rate(), rate()]}
    print(json.dumps(out))


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        return child(sys.argv[2])
    run = Run()
    lines = ["# The decode step on the main thread, on a second thread, and on the main thread again", "",
             "SmolLM2-135M-Instruct, the serving pool's decode step at batch 1 (300-token row), 2 torch threads, "
             "tok/s of two 40-step measurements each, one process per precision, in this order.", "",
             "| precision | main first | second thread | main after | second / first | after / first |",
             "|---|---|---|---|---:|---:|"]
    verdicts = []
    for dtype in ("q4_1", "bf16"):
        got = json.loads(subprocess.run([sys.executable, __file__, "--child", dtype], check=True, text=True,
                                        capture_output=True).stdout.strip().splitlines()[-1])
        first, second, after = (max(got[k]) for k in ("main first", "second thread", "main after"))
        fmt = lambda xs: " / ".join(f"{x:.1f}" for x in xs)  # noqa: E731
        lines.append(f"| {dtype} | {fmt(got['main first'])} | {fmt(got['second thread'])} | {fmt(got['main after'])} | "
                     f"{second / first:.2f} | {after / first:.2f} |")
        verdicts.append(second / first < 0.7 and after / first < 0.7)
        print(lines[-1], flush=True)
    lines += ["", "Criterion (set before the run): both ratios under 0.7 (best of the two measurements each): "
                  + ("**met** for every precision: after a second thread has run torch work, the step runs at under 0.7x its first rate, on either thread."
                     if all(verdicts) else "not met for every precision (see the rows).")]
    run.finish()
    print(run.write(results_dir("serving") / "serve_threads.md", "\n".join(lines)).read_text())


if __name__ == "__main__":
    main()
