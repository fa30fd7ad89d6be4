"""K-quant GGUF files (Q4_K_M, Q5_K_M, Q6_K of a random-weight model in a real model's shape, quantised by
llama.cpp's own quantiser) in tformer (``open_model`` at ``--dtype auto``: each matrix kept in its file
format) against llama.cpp on the same file: decode and prefill tok/s, load time, peak RSS; 1 and 2 threads.

Goals (issue 47): decode >= 1.2x llama.cpp, prefill >= 1.0x, peak RSS <= 1.1x, load <= 2x.

Each measurement is a fresh process (so load time and peak RSS are its own), alternated with llama.cpp
round by round (order reversed every other round). In a process: the load (``open_model`` / llama.cpp's
``Llama(...)``), a prompt of P random ids (prefill tok/s = P / its time), then N greedy tokens, each the
argmax of the logits (no sampler on either side); decode tok/s from two runs cut at N1 and N2 tokens,
(N2 - N1) / (t2 - t1), so the prompt and the first step cancel. Load: opening the model, after the
interpreter and libraries are imported. Peak RSS is the process's ``VmHWM`` (tformer's includes torch's
libraries, ~230 MB on this machine). llama.cpp runs with its defaults (mmap, repacking allowed).

    flock /tmp/tformer-bench.lock env PYTHONPATH=src:/work/llama_native \\
        .venv/bin/python benchmarks/quant/kquant_llama_cpp.py --files /tmp/kq/qwen05-q4_k_m.gguf ... --tag epyc

The files: tests/quant/kquant_files.py (``--make DIR`` writes Qwen2.5-0.5B's shape as f16 and the three
quantisations). Writes benchmarks/results/quant/kquant_llama_cpp[-TAG].md and .json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # benchmarks/, for common/
from common.record import Run, results_dir  # noqa: E402

CHILD = """
import json, sys, time
args = json.loads(sys.argv[1])

def peak_rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

ids, n = args["ids"], args["n"]
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
    t3 = time.perf_counter()
    for _ in range(n):
        llm.eval([tok])
        tok = last()
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
        t3 = time.perf_counter()
        for _ in range(n):
            tok = decode_step(model, tok, state).argmax(-1, keepdim=True)
        t4 = time.perf_counter()
    why = f"{opened.dtype}; {opened.path}; {torch.get_num_threads()} threads"
print(json.dumps({"load": t1 - t0, "prefill": t3 - t2, "decode": t4 - t3, "rss": peak_rss(), "how": why}))
"""


def child(spec: dict) -> dict:
    r = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], capture_output=True, text=True, check=False)
    if r.returncode:
        raise SystemExit(f"kquant_llama_cpp: a {spec['who']} run failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def make(folder: Path) -> list[Path]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "quant"))
    import kquant_files as kf

    folder.mkdir(parents=True, exist_ok=True)
    src = kf.write_gguf(kf.qwen2(0, **kf.QWEN25_05B), folder / "qwen05-f16.gguf")
    return [kf.quantize(src, folder / f"qwen05-{k}.gguf", k) for k in ("q4_k_m", "q5_k_m", "q6_k")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", nargs="*", type=Path, default=[])
    ap.add_argument("--make", type=Path, help="write the Qwen2.5-0.5B-shaped files into this folder first")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens P (default 128)")
    ap.add_argument("--short", type=int, default=16)
    ap.add_argument("--long", type=int, default=80)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    files = list(args.files) + (make(args.make) if args.make else [])
    run = Run()
    import random

    rng = random.Random(0)
    ids = [rng.randrange(100, 30000) for _ in range(args.prompt)]
    rows: dict = {}
    for path in files:
        for t in args.threads:
            for r in range(args.rounds):
                who = ["tformer", "llama.cpp"] if r % 2 == 0 else ["llama.cpp", "tformer"]
                for w in who:
                    spec = {"who": w, "path": str(path), "ids": ids, "threads": t}
                    short, long = child({**spec, "n": args.short}), child({**spec, "n": args.long})
                    row = {"decode": (args.long - args.short) / (long["decode"] - short["decode"]),
                           "prefill": args.prompt / statistics.median([short["prefill"], long["prefill"]]),
                           "load": statistics.median([short["load"], long["load"]]),
                           "rss": max(short["rss"], long["rss"]), "how": long["how"]}
                    rows.setdefault(f"{path.name}|{t}|{w}", []).append(row)
                    print(f"{path.name} {t}t round {r + 1} {w}: decode {row['decode']:.1f} tok/s, prefill "
                          f"{row['prefill']:.1f} tok/s, load {row['load']:.2f} s, RSS {row['rss'] / 2**20:.0f} MiB "
                          f"{row['how']}", flush=True)
    lines = ["# K-quant GGUF files: tformer vs llama.cpp on the same file", "",
             f"{args.rounds} alternated rounds per file and thread count; prompt {args.prompt} random ids; decode "
             f"rate from {args.short} and {args.long} greedy tokens; medians. Ratios are tformer / llama.cpp "
             "(goals: decode >= 1.2, prefill >= 1.0, RSS <= 1.1, load <= 2).", "",
             "| file | threads | tformer decode | llama.cpp decode | ratio | tformer prefill | llama.cpp prefill | ratio "
             "| RSS MiB (t / l) | ratio | load s (t / l) | ratio | tformer weights, path |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    summary, uneven = {}, []
    for path in files:
        for t in args.threads:
            a, b = rows[f"{path.name}|{t}|tformer"], rows[f"{path.name}|{t}|llama.cpp"]
            m = {k: (statistics.median(x[k] for x in a), statistics.median(x[k] for x in b))
                 for k in ("decode", "prefill", "rss", "load")}
            ratio = {k: v[0] / v[1] for k, v in m.items()}
            summary[f"{path.name} {t}t"] = {"tformer": {k: v[0] for k, v in m.items()},
                                            "llama.cpp": {k: v[1] for k, v in m.items()}, "ratio": ratio}
            # a median of 2 rounds is their mean: one slow round moves it (a llama.cpp round at 10 tok/s once did)
            for who, xs in (("tformer", a), ("llama.cpp", b)):
                rates = [x["decode"] for x in xs]
                if max(rates) > 1.5 * min(rates):
                    uneven.append(f"{path.name} {t}t {who} decode rounds {', '.join(f'{r:.1f}' for r in rates)}")
            lines.append(f"| {path.name} | {t} | {m['decode'][0]:.1f} | {m['decode'][1]:.1f} | {ratio['decode']:.2f} | "
                         f"{m['prefill'][0]:.1f} | {m['prefill'][1]:.1f} | {ratio['prefill']:.2f} | "
                         f"{m['rss'][0] / 2**20:.0f} / {m['rss'][1] / 2**20:.0f} | {ratio['rss']:.2f} | "
                         f"{m['load'][0]:.2f} / {m['load'][1]:.2f} | {ratio['load']:.2f} | {a[-1]['how']} |")
    if uneven:
        lines += ["", "Rounds more than 1.5x apart (their median is no measure of a goal; run again): "
                  + "; ".join(uneven) + "."]
    out = results_dir("quant") / f"kquant_llama_cpp{'-' + args.tag if args.tag else ''}"
    run.write(out.with_suffix(".md"), "\n".join(lines) + "\n")
    run.write_json(out.with_suffix(".json"), {"rows": rows, "summary": summary, "prompt": args.prompt})
    print("\n".join(lines))


if __name__ == "__main__":
    main()
