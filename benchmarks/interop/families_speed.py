"""The model families at their published sizes (Llama-3.2-1B, Qwen3-0.6B, Qwen2.5-0.5B, Gemma-3-270M,
Gemma-3-1B, Gemma-2-2B, Phi-3.5-mini: full depth, full vocabulary, random weights) in tformer against llama.cpp
on the same GGUF files: load time, peak RSS,
prefill and decode tok/s at f16, q8_0 and q4_0, 1 and 2 threads, fresh processes alternated round by round
(how each is measured: benchmarks/common/versus_llama_cpp.py).

Goal (issues 51, 52): q8_0 and q4_0 decode >= 1.0x llama.cpp's for every family at 2 threads.

The files: ``--make DIR`` writes ``FAMILY-f16.gguf`` with the ``gguf`` package as llama.cpp's converter lays
it out (tests/interop/families.py ``full_size_gguf``: random weights, the fixture vocabulary padded to the
published size under the family's pre-tokenizer; Phi-3.5's SentencePiece kind at its 32,064 ids) and ``FAMILY-q8_0.gguf`` / ``FAMILY-q4_0.gguf`` from it with
llama.cpp's quantiser (``llama_model_quantize``, which keeps its own choice for the tied head: Q6_K at
q4_0 where the width is a multiple of 256, else Q8_0). A run takes one family and some formats, so each
fits a short hold of the lock:

    export PYTHONPATH=$PWD/src:$PWD/tests/interop:$PWD/tests/quant:/work/llama_native
    .venv/bin/python benchmarks/interop/families_speed.py --make /work/bigfiles/families [--family phi-3.5-mini]
    flock /tmp/tformer-bench.gate flock /tmp/tformer-bench.lock .venv/bin/python \\
        benchmarks/interop/families_speed.py --dir /work/bigfiles/families --family qwen3-0.6b --formats q8_0
    .venv/bin/python benchmarks/interop/families_speed.py --table      # the docs table from the result files

Writes benchmarks/results/interop/families_speed-FAMILY-FORMATS-THREADSt[-TAG].md and .json; ``--table`` prints
the table of every such JSON result (docs/interop.md quotes it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # benchmarks/, for common/
from common.record import Run, results_dir  # noqa: E402
from common.versus_llama_cpp import HEADER, compare, summarise, uneven_note  # noqa: E402

FAMILIES = (
    "llama-3.2-1b", "qwen3-0.6b", "qwen2.5-0.5b-yarn",
    "gemma-3-270m", "gemma-3-1b", "gemma-2-2b",
    "phi-3.5-mini",
)
FORMATS = ("f16", "q8_0", "q4_0")
OUT = results_dir("interop")


def make(folder: Path, families=FAMILIES) -> None:
    """Write each family's f16 file (unless it or both quantisations are present) and its q8_0 / q4_0
    quantisations into ``folder``."""
    import families as F
    import kquant_files as kf

    folder.mkdir(parents=True, exist_ok=True)
    for family in families:
        src = folder / f"{family}-f16.gguf"
        wanted = [kind for kind in FORMATS[1:] if not (folder / f"{family}-{kind}.gguf").is_file()]
        if wanted and not src.is_file():
            F.full_size_gguf(family, src)
        for kind in wanted:
            kf.quantize(src, folder / f"{family}-{kind}.gguf", kind)
        print(f"{family}: written", flush=True)


def table() -> str:
    """The rows of every families_speed JSON result, by family, format and threads."""
    rows = []
    for path in sorted(OUT.glob("families_speed-*.json")):
        data = json.loads(path.read_text())
        for key, s in data["summary"].items():
            name, threads = key.rsplit(" ", 1)
            t, l, r = s["tformer"], s["llama.cpp"], s["ratio"]
            busy = max(max(x["busy"]) for who in ("tformer", "llama.cpp")
                       for x in data["rows"][f"{name}|{threads[:-1]}|{who}"])
            rows.append((name, threads, f"| {name.removesuffix('.gguf')} | {threads[:-1]} | {t['decode']:.1f} | "
                         f"{l['decode']:.1f} | **{r['decode']:.2f}** | {t['prefill']:.0f} | {l['prefill']:.0f} | "
                         f"{r['prefill']:.2f} | {t['rss'] / 2**20:.0f} / {l['rss'] / 2**20:.0f} | "
                         f"{t['load']:.2f} / {l['load']:.2f} | {busy:.2f} | `{path.name}` |"))
    order = {f"{f}-{k}.gguf": i for i, (f, k) in enumerate((f, k) for f in FAMILIES for k in FORMATS)}
    rows.sort(key=lambda x: (order.get(x[0], 99), x[1]))
    return "\n".join(["| file | threads | tformer decode tok/s | llama.cpp decode | ratio | tformer prefill | "
                      "llama.cpp prefill | ratio | peak RSS MiB (t / l) | load s (t / l) | most cores others kept busy "
                      "around a run | result |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
                      *(r[2] for r in rows)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--make", type=Path, help="write the families' files into this folder")
    ap.add_argument("--dir", type=Path, help="the folder --make wrote")
    ap.add_argument("--family", choices=FAMILIES)
    ap.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens P (default 64)")
    ap.add_argument("--short", type=int, default=16)
    ap.add_argument("--long", type=int, default=144)
    ap.add_argument("--tag", default="")
    ap.add_argument("--table", action="store_true", help="print the table of every result file and stop")
    args = ap.parse_args()
    if args.table:
        print(table())
        return
    if args.make:
        make(args.make, [args.family] if args.family else FAMILIES)
        return
    if not (args.dir and args.family):
        raise SystemExit("families_speed: name --dir (the folder --make wrote) and --family, or --make / --table.")
    files = [args.dir / f"{args.family}-{k}.gguf" for k in args.formats]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise SystemExit(f"families_speed: {', '.join(missing)} missing; write them with --make {args.dir}.")
    run = Run()
    rows = compare(files, args.threads, args.rounds, args.prompt, args.short, args.long)
    run.finish()
    lines, summary, uneven = summarise(rows, files, args.threads)
    text = ["# Model families at full size: tformer vs llama.cpp on the same GGUF file", "",
            f"{args.rounds} alternated rounds per file and thread count; prompt {args.prompt} random ids; decode rate "
            f"between greedy tokens {args.short} and {args.long} of one run; medians. Ratios are tformer / llama.cpp (goal: q8_0 "
            "and q4_0 decode >= 1.0 at 2 threads). Each round's busy cores are in the JSON file.", "",
            *HEADER, *lines]
    text += ["", "Each run (decode tok/s; cores other processes kept busy before / after it):", ""]
    for key, xs in rows.items():
        text.append(f"- {key.replace('|', ' ')}: " + "; ".join(f"{x['decode']:.1f} ({x['busy'][0]:.2f} / "
                                                                  f"{x['busy'][1]:.2f})" for x in xs))
    text += uneven_note(uneven)
    threads = "-".join(map(str, args.threads))
    run.write_result("interop", f"families_speed-{args.family}-{'-'.join(args.formats)}-{threads}t", args.tag,
                     "\n".join(text) + "\n", {"rows": rows, "summary": summary, "prompt": args.prompt})
    print("\n".join(text))


if __name__ == "__main__":
    main()
