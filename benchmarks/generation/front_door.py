"""The front door as a newcomer meets it: `tformer chat --prompt` (what `make chat` runs) against
`tformer generate` at the same settings and llama.cpp on the same file (SmolLM2-135M-Instruct's Q4_1
GGUF), each in a fresh process, alternated round by round.

Goals (issue 46, stated before the run): chat's decode tok/s >= 0.9x generate's and >= 1.0x llama.cpp's
(2 threads; the decode rate from the difference of two answer lengths, so prompt and load cancel); the
first start writes no float checkpoint and opens the model in <= 2x llama.cpp's load time of the same file.

Per round and contender, two runs of the same greedy answer cut at N1 and N2 new tokens:
rate = (n2 - n1) / (t2 - t1), where t is the time the command itself reports for its answer (chat and
generate print "n tokens in t s"; llama.cpp is timed around its prompt and decode calls). Load: the
time to open the model in-process (chat's "model loaded in", i.e. ``open_model``; llama.cpp's
``Llama(...)`` constructor), after the interpreter and libraries are imported; llama.cpp maps the file
and reads its pages at the first evaluation, so "to the first answer" (load + the N1-token answer, prompt
included) is reported beside it, where both have read every weight, and "the whole command" (tformer's
``main(argv)`` from parsing to the printed answer; llama.cpp's constructor to its last token), which also
counts what runs between the open and the answer's timer (the template, the prompt's ids): tformer makes
its tiles on a second thread beside those, so only this column shows all of their cost. System time:
``getrusage``'s kernel CPU seconds, inside the load and for the whole process (the first writes into fresh
memory cost this VM far more some runs than others, with the same fault count). Peak RSS: the process's
own high-water mark (``VmHWM``; ``ru_maxrss`` would keep this parent's across ``exec``); tformer's includes
torch's libraries, the llama.cpp process imports no torch. llama.cpp decodes N greedy tokens after the same prompt ids (the chat template
rendered and encoded by tformer), taking the argmax of its logits (no Python sampler).

    flock -w 900 /tmp/tformer-bench.lock env PYTHONPATH=/path/to/llama_cpp_python:src \\
        .venv/bin/python benchmarks/generation/front_door.py --rounds 3 --tag epyc [--baseline ../main/src]

``--baseline`` adds another checkout's ``tformer chat`` as a fourth contender in the same alternation (an
A/B of two tformers in one run). Python's bytecode is cached for the children (``--bytecode cached``, one
untimed run of each contender first), as an installed tformer runs; ``--bytecode as-is`` keeps the
environment's setting (``PYTHONDONTWRITEBYTECODE=1`` compiles every module opening imports, at every start).

Writes benchmarks/results/generation/front_door[-TAG].md and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # benchmarks/, for common/
from common.first_start import first_start_env  # noqa: E402
from common.record import Run  # noqa: E402

PROMPT = "Write a very long story about a dragon who learns to cook, with many chapters."
CHILD = """
import json, resource, sys, time
args = json.loads(sys.argv[1])

def sys_time():                  # system (kernel) CPU seconds of this process so far: the first writes' page faults
    return resource.getrusage(resource.RUSAGE_SELF).ru_stime

def peak_rss():                  # VmHWM: this process's own peak (ru_maxrss keeps the parent's across exec)
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

if args["who"] == "llama.cpp":
    import llama_cpp
    import numpy as np
    n_ctx = len(args["ids"]) + args["n"] + 8
    s1, t1 = sys_time(), time.perf_counter()
    llm = llama_cpp.Llama(model_path=args["path"], n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                          n_threads=args["threads"], n_threads_batch=args["threads"], verbose=False)
    t2, s2 = time.perf_counter(), sys_time()
    vocab = llm.n_vocab()

    def last():
        ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
        return int(np.ctypeslib.as_array(ptr, shape=(vocab,)).argmax())

    start = time.perf_counter()
    llm.eval(args["ids"])
    for _ in range(args["n"] - 1):
        llm.eval([last()])
    seconds = time.perf_counter() - start
    print(json.dumps({"tokens": args["n"], "seconds": seconds, "load": t2 - t1, "whole": time.perf_counter() - t1,
                      "sys_load": s2 - s1, "sys": sys_time(), "rss": peak_rss()}))
else:
    import contextlib, io, re
    import tformer.inference
    from tformer.cli import main
    opening, marks = tformer.inference.open_model, {}

    def timed_open(*a, **kw):    # the system time inside the open (the commands import open_model when they run)
        s = sys_time()
        try:
            return opening(*a, **kw)
        finally:
            marks["sys_load"] = sys_time() - s

    tformer.inference.open_model = timed_open
    err = io.StringIO()
    t1 = time.perf_counter()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(args["argv"])
    whole = time.perf_counter() - t1
    assert rc == 0, err.getvalue()
    text = err.getvalue()
    m = re.search(r"(\\d+) tokens in ([\\d.]+) s", text)
    load = re.search(r"opened in ([\\d.]+) s", text)
    print(json.dumps({"tokens": int(m.group(1)), "seconds": float(m.group(2)), "load": float(load.group(1)),
                      "whole": whole, "sys_load": marks["sys_load"], "sys": sys_time(), "rss": peak_rss()}))
"""


def child(spec: dict, env: dict) -> dict:
    r = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], capture_output=True, text=True, env=env,
                       check=False)
    if r.returncode:
        raise SystemExit(f"front_door: a {spec['who']} run failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--short", type=int, default=32, help="N1 new tokens (default 32)")
    ap.add_argument("--long", type=int, default=160, help="N2 new tokens (default 160)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--baseline", default="", help="the src/ folder of another tformer checkout: its chat runs as a "
                    "fourth contender, alternated with the others (an A/B in one run)")
    ap.add_argument("--bytecode", choices=("cached", "as-is"), default="cached",
                    help="cached (default): the children write and reuse Python's bytecode in a private folder, "
                         "warmed by one untimed run each, as an installed tformer runs; as-is: the environment's "
                         "setting (PYTHONDONTWRITEBYTECODE=1 compiles every module opening imports, at every start)")
    args = ap.parse_args()
    run = Run()
    from tformer.interop.builtin import builtin_path
    from tformer.inference import open_model

    path = builtin_path("smollm2")
    opened = open_model("smollm2")
    rendered = opened.template.render([{"role": "user", "content": PROMPT}])
    ids = opened.template.encode(opened.tokenizer, [{"role": "user", "content": PROMPT}])
    del opened
    env, cache = first_start_env("tformer-front-door-", bytecode=args.bytecode == "cached")
    common = ["--temperature", "0", "--threads", str(args.threads), "--verbose"]
    specs = {
        "tformer chat": lambda n: {"who": "chat", "argv": ["chat", "--prompt", PROMPT, "--max-new-tokens", str(n), *common]},
        "tformer generate": lambda n: {"who": "generate", "argv": ["generate", "--model", "smollm2", "--prompt", rendered,
                                                                   "--max-new-tokens", str(n), *common]},
        "llama.cpp": lambda n: {"who": "llama.cpp", "path": str(path), "ids": ids, "n": n, "threads": args.threads},
    }
    envs = {name: env for name in specs}
    if args.baseline:
        specs["tformer chat (baseline)"] = specs["tformer chat"]
        paths = [str(Path(args.baseline).resolve())] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                      if p and Path(p).resolve() != Path("src").resolve()]
        envs["tformer chat (baseline)"] = {**env, "PYTHONPATH": os.pathsep.join(paths)}
    if args.bytecode == "cached":
        for name in specs:                    # untimed: writes the bytecode a second start would find
            child(specs[name](2), envs[name])
    rows = {name: [] for name in specs}
    for r in range(args.rounds):
        order = list(specs) if r % 2 == 0 else list(reversed(specs))
        for name in order:
            short, long = child(specs[name](args.short), envs[name]), child(specs[name](args.long), envs[name])
            rate = (long["tokens"] - short["tokens"]) / (long["seconds"] - short["seconds"])
            rows[name].append({"rate": rate, "load": statistics.median([short["load"], long["load"]]),
                               "first": short["load"] + short["seconds"], "whole": short["whole"],
                               "sys_load": statistics.median([short["sys_load"], long["sys_load"]]),
                               "sys": short["sys"],
                               "rss": max(short["rss"], long["rss"]), "tokens": [short["tokens"], long["tokens"]]})
            print(f"round {r + 1} {name}: {rate:.1f} tok/s, load {rows[name][-1]['load']:.2f} s "
                  f"(system {rows[name][-1]['sys_load']:.3f} s), first {rows[name][-1]['first']:.2f} s, "
                  f"whole {rows[name][-1]['whole']:.2f} s (system {rows[name][-1]['sys']:.3f} s), "
                  f"RSS {rows[name][-1]['rss'] / 2**20:.0f} MiB, tokens {rows[name][-1]['tokens']}", flush=True)
    converted = sorted(p.name for p in (cache / "gguf").iterdir()) if (cache / "gguf").is_dir() else []

    def med(name, key):
        return statistics.median(x[key] for x in rows[name])

    def ratio(a, b, key):
        return statistics.median(x[key] / y[key] for x, y in zip(rows[a], rows[b]))

    summary = {
        "chat / generate decode": ratio("tformer chat", "tformer generate", "rate"),
        "chat / llama.cpp decode": ratio("tformer chat", "llama.cpp", "rate"),
        "chat / llama.cpp load time": ratio("tformer chat", "llama.cpp", "load"),
        "chat / llama.cpp load to the first answer": ratio("tformer chat", "llama.cpp", "first"),
        "chat / llama.cpp peak RSS": ratio("tformer chat", "llama.cpp", "rss"),
        "float checkpoints written by the first start": converted,
    }
    if args.baseline:
        summary["chat / baseline chat load time"] = ratio("tformer chat", "tformer chat (baseline)", "load")
        summary["chat / baseline chat decode"] = ratio("tformer chat", "tformer chat (baseline)", "rate")
        summary["chat / baseline chat load + first answer"] = ratio("tformer chat", "tformer chat (baseline)", "first")
        summary["chat / baseline chat whole command"] = ratio("tformer chat", "tformer chat (baseline)", "whole")
    lines = ["# The front door: tformer chat vs tformer generate vs llama.cpp, SmolLM2-135M-Instruct Q4_1", "",
             f"{args.rounds} rounds, {args.threads} threads, greedy, decode rate from {args.short} and {args.long} new "
             f"tokens; prompt: {len(ids)} tokens (the chat template around {PROMPT!r}); Python bytecode "
             f"{'cached (written by one untimed run of each contender)' if args.bytecode == 'cached' else 'as the environment has it'}"
             + (f"; baseline: tformer at {args.baseline}" if args.baseline else "") + ".", "",
             "| contender | decode tok/s (median) | per round | load s (median) | loads per round | system s in the load "
             f"| load + first answer s | the whole command, {args.short}-token answer s (its system s) | peak RSS MiB |",
             "|---|---:|---|---:|---|---:|---:|---:|---:|"]
    for name in specs:
        rounds = " / ".join(f"{x['rate']:.1f}" for x in rows[name])
        loads = " / ".join(f"{x['load']:.3f}" for x in rows[name])
        lines.append(f"| {name} | {med(name, 'rate'):.1f} | {rounds} | {med(name, 'load'):.3f} | {loads} | "
                     f"{med(name, 'sys_load'):.3f} | {med(name, 'first'):.3f} | {med(name, 'whole'):.3f} "
                     f"({med(name, 'sys'):.3f}) | {med(name, 'rss') / 2**20:.0f} |")
    lines += ["", "| ratio (median of per-round ratios) | value | goal |", "|---|---:|---|",
              f"| chat / generate, decode | {summary['chat / generate decode']:.2f} | >= 0.9 |",
              f"| chat / llama.cpp, decode | {summary['chat / llama.cpp decode']:.2f} | >= 1.0 |",
              f"| chat / llama.cpp, load time | {summary['chat / llama.cpp load time']:.2f} | <= 2 |",
              f"| chat / llama.cpp, load + the {args.short}-token answer | "
              f"{summary['chat / llama.cpp load to the first answer']:.2f} | (reported) |",
              f"| chat / llama.cpp, peak RSS | {summary['chat / llama.cpp peak RSS']:.2f} | (reported) |",
              *([f"| chat / baseline chat, load time | {summary['chat / baseline chat load time']:.2f} | (reported) |",
                 f"| chat / baseline chat, decode | {summary['chat / baseline chat decode']:.2f} | (reported) |",
                 f"| chat / baseline chat, load + first answer | {summary['chat / baseline chat load + first answer']:.2f} | (reported) |",
                 f"| chat / baseline chat, the whole command | {summary['chat / baseline chat whole command']:.2f} | (reported) |"]
                if args.baseline else []),
              "", f"Float checkpoints the first starts wrote into their fresh cache: {converted or 'none'}."]
    run.write_result("generation", "front_door", args.tag, "\n".join(lines) + "\n",
                     {"rows": rows, "summary": summary, "prompt_tokens": len(ids)})
    print("\n".join(lines))


if __name__ == "__main__":
    main()
