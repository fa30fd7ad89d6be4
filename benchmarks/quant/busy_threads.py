"""Decode beside a busy neighbour: one ``yes > /dev/null`` on the machine, tformer at its default threads
(``open_model(threads=None)``: torch's count less the cores others keep busy while the model loads,
:class:`tformer.machine.FreeCores`) against fixed 1 and 2 threads, and llama.cpp at its default and at 2.

Goal (issue 47): tformer's default >= 0.9x its best fixed thread count, and >= 2x llama.cpp's default.
Each run a fresh process (benchmarks/common/versus_llama_cpp.py's child: prompt, then greedy tokens, the
decode rate from two lengths), the contenders alternated round by round, the ``yes`` started before and
stopped after each round.

    flock /tmp/tformer-bench.lock env PYTHONPATH=src:/work/llama_native \\
        .venv/bin/python benchmarks/quant/busy_threads.py --files smollm2 /tmp/kq/qwen05-q4_k_m.gguf

Writes benchmarks/results/quant/busy_threads[-TAG].md and .json.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # benchmarks/, for common/ and quant/
from common.record import Run  # noqa: E402
from common.versus_llama_cpp import child  # noqa: E402

CONTENDERS = [("tformer", None), ("tformer", 1), ("tformer", 2), ("llama.cpp", None), ("llama.cpp", 2)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", nargs="+", default=["smollm2"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--short", type=int, default=16)
    ap.add_argument("--long", type=int, default=64)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    from tformer.interop.builtin import builtin_path

    run = Run()
    rng = random.Random(0)
    ids = [rng.randrange(100, 30000) for _ in range(args.prompt)]
    rows: dict = {}
    for spec in args.files:
        path = str(builtin_path("smollm2")) if spec == "smollm2" else spec
        for r in range(args.rounds):
            order = CONTENDERS if r % 2 == 0 else CONTENDERS[::-1]
            hog = subprocess.Popen(["yes"], stdout=subprocess.DEVNULL)
            try:
                for who, threads in order:
                    base = {"who": who, "path": path, "ids": ids, "threads": threads}
                    short, long = child({**base, "n": args.short}), child({**base, "n": args.long})
                    rate = (args.long - args.short) / (long["decode"] - short["decode"])
                    key = f"{Path(path).name}|{who}|{threads or 'default'}"
                    rows.setdefault(key, []).append({"decode": rate, "how": long["how"]})
                    print(f"{Path(path).name} round {r + 1} {who} threads {threads or 'default'}: {rate:.1f} tok/s "
                          f"({long['how']})", flush=True)
            finally:
                hog.kill()
                hog.wait()
    lines = ["# Decode beside one `yes > /dev/null`: default threads against fixed ones", "",
             f"{args.rounds} alternated rounds; prompt {args.prompt} random ids; decode rate from {args.short} and "
             f"{args.long} greedy tokens; medians (tok/s). Goals: tformer default >= 0.9x its best fixed count, "
             ">= 2x llama.cpp's default.", "",
             "| file | tformer default (threads chosen) | tformer 1 | tformer 2 | default / best fixed | llama.cpp default "
             "| llama.cpp 2 | tformer default / llama.cpp default |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    summary = {}
    for spec in args.files:
        name = Path(str(builtin_path("smollm2")) if spec == "smollm2" else spec).name
        med = {k.split("|", 1)[1]: statistics.median(x["decode"] for x in v) for k, v in rows.items()
               if k.startswith(name + "|")}
        chosen = rows[f"{name}|tformer|default"][-1]["how"].rsplit("; ", 1)[-1]
        best = max(med["tformer|1"], med["tformer|2"])
        summary[name] = {**med, "default/best": med["tformer|default"] / best,
                         "default/llama.cpp default": med["tformer|default"] / med["llama.cpp|default"]}
        lines.append(f"| {name} | {med['tformer|default']:.1f} ({chosen}) | {med['tformer|1']:.1f} | {med['tformer|2']:.1f} | "
                     f"{summary[name]['default/best']:.2f} | {med['llama.cpp|default']:.1f} | {med['llama.cpp|2']:.1f} | "
                     f"{summary[name]['default/llama.cpp default']:.2f} |")
    run.write_result("quant", "busy_threads", args.tag, "\n".join(lines) + "\n", {"rows": rows, "summary": summary})
    print("\n".join(lines))


if __name__ == "__main__":
    main()
