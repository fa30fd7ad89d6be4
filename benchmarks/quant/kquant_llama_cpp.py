"""K-quant GGUF files (Q4_K_M, Q5_K_M, Q6_K of a random-weight model in a real model's shape, quantised by
llama.cpp's own quantiser) in tformer (``open_model`` at ``--dtype auto``: each matrix kept in its file
format) against llama.cpp on the same file: decode and prefill tok/s, load time, peak RSS; 1 and 2 threads.

Goals (issue 47): decode >= 1.2x llama.cpp, prefill >= 1.0x, peak RSS <= 1.1x, load <= 2x.

Each measurement is a fresh process, alternated with llama.cpp round by round (how each is measured:
benchmarks/common/versus_llama_cpp.py).

    flock /tmp/tformer-bench.lock env PYTHONPATH=src:/work/llama_native \\
        .venv/bin/python benchmarks/quant/kquant_llama_cpp.py --files /tmp/kq/qwen05-q4_k_m.gguf ... --tag epyc

The files: tests/quant/kquant_files.py (``--make DIR`` writes Qwen2.5-0.5B's shape as f16 and the three
quantisations). Writes benchmarks/results/quant/kquant_llama_cpp[-TAG].md and .json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # benchmarks/, for common/
from common.record import Run  # noqa: E402
from common.versus_llama_cpp import HEADER, compare, summarise, uneven_note  # noqa: E402


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
    ap.add_argument("--before", help="another tformer tree's src folder (e.g. main's), run in the same rounds: "
                                     "a change's before and after")
    args = ap.parse_args()
    files = list(args.files) + (make(args.make) if args.make else [])
    run = Run()
    rows = compare(files, args.threads, args.rounds, args.prompt, args.short, args.long, args.before)
    table, summary, uneven = summarise(rows, files, args.threads)
    lines = ["# K-quant GGUF files: tformer vs llama.cpp on the same file", "",
             f"{args.rounds} alternated rounds per file and thread count; prompt {args.prompt} random ids; decode "
             f"rate from {args.short} and {args.long} greedy tokens; medians. Ratios are tformer / llama.cpp "
             "(goals: decode >= 1.2, prefill >= 1.0, RSS <= 1.1, load <= 2).", "", *HEADER, *table]
    if args.before:
        old, summary["before"], was = summarise(rows, files, args.threads, "tformer-before")
        lines += ["", f"Before the change (`{args.before}`), in the same rounds:", "", *HEADER, *old]
        uneven += was
    lines += uneven_note(uneven)
    run.write_result("quant", "kquant_llama_cpp", args.tag, "\n".join(lines) + "\n",
                     {"rows": rows, "summary": summary, "prompt": args.prompt})
    print("\n".join(lines))


if __name__ == "__main__":
    main()
