"""tformer against llama.cpp on the same GGUF files, each measurement a fresh process, alternated round by
round: load time, peak RSS, prefill and decode tok/s (behind quant/kquant_llama_cpp.py and
interop/families_speed.py; quant/busy_threads.py runs its :func:`child`).

In a process: the load (``open_model`` at ``--dtype auto``, each matrix kept in its file format /
llama.cpp's ``Llama(...)`` with its defaults: mmap, repacking allowed), a prompt of P ids (prefill tok/s =
P / its time), then N greedy tokens, each the argmax of the logits (no sampler on either side; llama.cpp
through ``eval`` and ``llama_get_logits_ith``). The decode rate comes from the clock at token N1 and at
token N2, (N2 - N1) / (t2 - t1), so load, prompt and the first steps cancel. Load: opening the model,
after the interpreter and libraries are imported. Peak RSS is the process's ``VmHWM`` (tformer's includes
torch's libraries). The order within a round is reversed every other round; each run waits for a quiet
machine (up to 10 s) and the cores other processes kept busy are sampled (1 s) before and after it, so
each row carries the load it ran under.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tformer.machine import busy_cores

CHILD = """
import json, sys, time
args = json.loads(sys.argv[1])

def peak_rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

ids, n, mark = args["ids"], args["n"], args.get("mark", 0)
if args["who"] == "llama.cpp":
    import llama_cpp
    import numpy as np
    n_ctx = len(ids) + n + 8
    t0 = time.perf_counter()
    threads = {} if args["threads"] is None else {"n_threads": args["threads"], "n_threads_batch": args["threads"]}
    llm = llama_cpp.Llama(model_path=args["path"], n_ctx=n_ctx, n_batch=len(ids), n_ubatch=len(ids), verbose=False,
                          **threads)                                  # None: llama-cpp-python's default
    t1 = time.perf_counter()
    vocab = llm.n_vocab()

    def last():
        ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
        return int(np.ctypeslib.as_array(ptr, shape=(vocab,)).argmax())

    t2 = time.perf_counter()
    llm.eval(ids)
    tok = last()
    t3 = tm = time.perf_counter()
    for i in range(n):
        llm.eval([tok])
        tok = last()
        if i + 1 == mark:
            tm = time.perf_counter()
    t4 = time.perf_counter()
    why = f"{llm.n_threads} threads" if hasattr(llm, "n_threads") else ""
else:
    import torch
    from tformer.inference import open_model
    from tformer.generation.step import decode_step, prefill
    t0 = time.perf_counter()
    opened = open_model(args["path"], threads=args["threads"])      # None: open_model chooses
    t1 = time.perf_counter()
    model = opened.model
    state = model.new_state(1, len(ids) + n + 8)
    with torch.inference_mode():
        t2 = time.perf_counter()
        tok = prefill(model, torch.tensor([ids]), state).argmax(-1, keepdim=True)
        t3 = tm = time.perf_counter()
        for i in range(n):
            tok = decode_step(model, tok, state).argmax(-1, keepdim=True)
            if i + 1 == mark:
                tm = time.perf_counter()
        t4 = time.perf_counter()
    why = f"{opened.dtype}; {opened.path}; {torch.get_num_threads()} threads"
print(json.dumps({"load": t1 - t0, "prefill": t3 - t2, "decode": t4 - t3, "at_mark": tm - t3, "rss": peak_rss(),
                  "how": why}))
"""


def child(spec: dict) -> dict:
    env = None
    if spec.get("src"):                      # another tformer tree first on the path (a before / after run)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([spec["src"], os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], capture_output=True, text=True, check=False,
                       env=env)
    if r.returncode:
        raise SystemExit(f"versus_llama_cpp: a {spec['who']} run failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def quiet(limit: float = 0.3, patience: float = 10.0) -> float:
    """Wait up to ``patience`` seconds for the cores other processes keep busy to fall to ``limit`` or less
    (sampled each second); the last sample."""
    start = time.perf_counter()
    busy = busy_cores()
    while busy > limit and time.perf_counter() - start < patience:
        busy = busy_cores()
    return busy


def compare(files: list[Path], threads: list[int], rounds: int, prompt: int, short: int, long: int,
            before: str | None = None) -> dict:
    """``{"file|threads|who": [row per round]}``, each row the decode and prefill rates, load time, peak
    RSS, how tformer ran (format, path, threads) and the cores others kept busy before and after the run.

    One process per row: its decode rate is (long - short) / (time at token ``long`` - time at token
    ``short``), so load, prompt and the first steps cancel. Each run waits (up to 10 s) for a quiet machine.
    ``before``: another tformer tree's ``src`` folder, run as ``tformer-before`` in the same rounds (a change's
    before and after in one alternated run)."""
    rng = random.Random(0)
    ids = [rng.randrange(100, 30000) for _ in range(prompt)]
    rows: dict = {}
    for path in files:
        for t in threads:
            for r in range(rounds):
                who = ["tformer", "llama.cpp"] + (["tformer-before"] if before else [])
                for w in (who if r % 2 == 0 else who[::-1]):
                    quiet_before = quiet()
                    a = child({"who": w, "path": str(path), "ids": ids, "threads": t, "n": long, "mark": short,
                               "src": before if w == "tformer-before" else None})
                    after = busy_cores()
                    row = {"decode": (long - short) / (a["decode"] - a["at_mark"]), "prefill": prompt / a["prefill"],
                           "load": a["load"], "rss": a["rss"], "how": a["how"],
                           "busy": [round(quiet_before, 2), round(after, 2)]}
                    rows.setdefault(f"{path.name}|{t}|{w}", []).append(row)
                    print(f"{path.name} {t}t round {r + 1} {w}: decode {row['decode']:.1f} tok/s, prefill "
                          f"{row['prefill']:.1f} tok/s, load {row['load']:.2f} s, RSS {row['rss'] / 2**20:.0f} MiB, "
                          f"{quiet_before:.2f} / {after:.2f} cores busy before / after; {row['how']}", flush=True)
    return rows


HEADER = ["| file | threads | tformer decode | llama.cpp decode | ratio | tformer prefill | llama.cpp prefill | ratio "
          "| RSS MiB (t / l) | ratio | load s (t / l) | ratio | tformer weights, path |",
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]


def summarise(rows: dict, files: list[Path], threads: list[int], who: str = "tformer") -> tuple[list[str], dict, list[str]]:
    """(table lines after :data:`HEADER`, medians and ratios per ``"file Nt"``, rounds more than 1.5x apart),
    for the runs of ``who`` (``tformer``, or ``tformer-before``) against llama.cpp's."""
    lines, summary, uneven = [], {}, []
    for path in files:
        for t in threads:
            a, b = rows[f"{path.name}|{t}|{who}"], rows[f"{path.name}|{t}|llama.cpp"]
            m = {k: (statistics.median(x[k] for x in a), statistics.median(x[k] for x in b))
                 for k in ("decode", "prefill", "rss", "load")}
            ratio = {k: v[0] / v[1] for k, v in m.items()}
            summary[f"{path.name} {t}t"] = {"tformer": {k: v[0] for k, v in m.items()},
                                            "llama.cpp": {k: v[1] for k, v in m.items()}, "ratio": ratio,
                                            "how": a[-1]["how"]}
            # a median of 2 rounds is their mean: one slow round moves it (a llama.cpp round at 10 tok/s once did)
            for side, xs in ((who, a), ("llama.cpp", b)):
                rates = [x["decode"] for x in xs]
                if max(rates) > 1.5 * min(rates):
                    uneven.append(f"{path.name} {t}t {side} decode rounds {', '.join(f'{r:.1f}' for r in rates)}")
            lines.append(f"| {path.name} | {t} | {m['decode'][0]:.1f} | {m['decode'][1]:.1f} | {ratio['decode']:.2f} | "
                         f"{m['prefill'][0]:.1f} | {m['prefill'][1]:.1f} | {ratio['prefill']:.2f} | "
                         f"{m['rss'][0] / 2**20:.0f} / {m['rss'][1] / 2**20:.0f} | {ratio['rss']:.2f} | "
                         f"{m['load'][0]:.2f} / {m['load'][1]:.2f} | {ratio['load']:.2f} | {a[-1]['how']} |")
    return lines, summary, uneven


def uneven_note(uneven: list[str]) -> list[str]:
    """The result's closing lines naming the rounds more than 1.5x apart (none: no lines)."""
    if not uneven:
        return []
    return ["", "Rounds more than 1.5x apart (their median is no measure of a goal; run again): "
            + "; ".join(uneven) + "."]
