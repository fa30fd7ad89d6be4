"""Serving throughput and latency: `tformer serve` against `transformers serve`, same weights, same run.

The model is GPT-2 124M's shape with random weights (transformers' GPT2LMHeadModel, saved once and
converted with `tformer convert --from-hf`), and a word-level tokenizer over its 50257 ids, so
every request is exactly ``--prompt-tokens`` in and up to ``--max-tokens`` out (``w123`` is token 123).
The servers run as subprocesses on 127.0.0.1 with the same torch thread count: tformer serve, and
``--peers`` of transformers serve: ``transformers`` (its default: requests run one after another,
each through ``model.generate`` on one inference thread) and ``transformers-cb`` (its
``--continuous-batching`` mode, paged attention). For each number of concurrent streams each server
gets ``--rounds`` rounds, rotating which goes first; in a round every stream sends one streaming
greedy completion. Reported per server: total generated tokens/s (medians over rounds), and p50/p99
of the request latency and of the gap between two streamed tokens. Before timing, every server's
greedy text for one prompt is compared.

To explain the ratio between servers, the same run first times *plain generation in this process*
(no server: ``tformer.generate`` and transformers' ``model.generate``, batch 1, the same prompt and
new tokens, alternating, medians): the servers' 1-stream ratio is then (the models' own speed
ratio) × (each server's overhead per request, its 1-stream tokens/s over its plain generation's),
and at more streams × what batching adds.

Success criteria (set before the runs): 8 streams give >= 3x the total tokens/s of one stream for
tformer serve, and >= 1.5x transformers serve at 8 streams.

    flock /tmp/tformer-bench.lock env PYTHONPATH=$PWD/src python benchmarks/serving/serve.py

Needs the bench extra (`accelerate`, which `transformers serve` loads the model with) and the serve
extra. Writes benchmarks/results/serving/serve.md and serve.png (``--name`` changes the stem).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # benchmarks/, for common/
from common.http_server import concurrently, pct, start  # noqa: E402
from common.record import Run, load_note, results_dir  # noqa: E402
from tformer.machine import busy_cores  # noqa: E402

RESULTS = results_dir("serving")


def make_weights(folder: Path, n_layers: int) -> None:
    """GPT-2 (random weights, seed 0) and a word-level tokenizer ``w0 .. w50256`` in HF's layout."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = GPT2Config(n_layer=n_layers)
    GPT2LMHeadModel(config).eval().save_pretrained(folder)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(config.vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")          # joins words with spaces
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w50256", unk_token="w0").save_pretrained(folder)


def stream_one(url: str, model: str, prompt: str, max_tokens: int) -> dict:
    """One streaming greedy completion: latency, token arrival gaps, generated tokens (from usage)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start_t, arrivals, tokens = time.perf_counter(), [], None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if any(c.get("text") for c in chunk.get("choices", [])):
                arrivals.append(time.perf_counter())
    end = time.perf_counter()
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return {"latency": end - start_t, "gaps": gaps, "tokens": tokens if tokens is not None else len(arrivals)}


def round_(url: str, model: str, streams: int, prompt_tokens: int, max_tokens: int, rng: random.Random) -> dict:
    prompts = [" ".join(f"w{rng.randrange(50000)}" for _ in range(prompt_tokens)) for _ in range(streams)]
    results: list[dict] = [{}] * streams

    def work(i: int) -> None:
        results[i] = stream_one(url, model, prompts[i], max_tokens)
    wall = concurrently(work, streams)
    return {"tokens_per_s": sum(r["tokens"] for r in results) / wall,
            "latencies": [r["latency"] for r in results], "gaps": [g for r in results for g in r["gaps"]]}


def plain_generation(hf: Path, ckpt: Path, prompt_tokens: int, new_tokens: int, rounds: int) -> dict[str, float]:
    """Tokens/s of batch-1 greedy generation in this process (no server), per model, alternating; medians."""
    import torch
    from transformers import GPT2LMHeadModel

    from tformer.checkpoint import load_model
    from tformer.generation.generate import generate

    hf_model = GPT2LMHeadModel.from_pretrained(hf).eval()
    tf_model = load_model(ckpt).eval()
    ids = torch.arange(1, prompt_tokens + 1)[None]
    runs = {"tformer": lambda: generate(tf_model, ids, new_tokens, temperature=0),
            "transformers": lambda: hf_model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                                      do_sample=False, pad_token_id=0)}
    times: dict[str, list[float]] = {n: [] for n in runs}
    with torch.inference_mode():
        for f in runs.values():                                    # warm-up
            f()
        for r in range(rounds):
            for n in (list(runs) if r % 2 == 0 else list(reversed(runs))):
                t = time.perf_counter()
                runs[n]()
                times[n].append(time.perf_counter() - t)
    return {n: new_tokens / statistics.median(ts) for n, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12, help="GPT-2 layers (12 = the 124M shape)")
    ap.add_argument("--streams", default="1,2,4,8,16")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--peers", default="transformers,transformers-cb",
                    help="comma-separated: transformers, transformers-cb (its --continuous-batching), or none")
    ap.add_argument("--name", default="serve", help="results file stem under benchmarks/results/serving (default: serve)")
    args = ap.parse_args()
    args.run = Run(measure_load=False)
    work = Path(tempfile.mkdtemp(prefix="tformer-serve-bench-"))
    hf, ckpt = work / "hf", work / "tformer"
    make_weights(hf, args.layers)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(args.threads),
           "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    subprocess.run([sys.executable, "-m", "tformer.cli", "convert", "--from-hf", str(hf), "--out", str(ckpt)],
                   env=env, check=True, stdout=subprocess.DEVNULL)
    ports = {"tformer": 18401, "transformers": 18402, "transformers-cb": 18403}
    servers = {"tformer": [sys.executable, "-m", "tformer.cli", "serve", "--ckpt", str(ckpt), "--port",
                           str(ports["tformer"]), "--threads", str(args.threads), "--slots", "16"]}
    peers = [p for p in args.peers.split(",") if p and p != "none"]
    exe = Path(sys.executable).with_name("transformers")
    for peer in peers:
        servers[peer] = [str(exe), "serve", str(hf), "--port", str(ports[peer]), "--device", "cpu"] + \
            (["--continuous-batching"] if peer == "transformers-cb" else [])
    plain = {}
    if peers:
        import torch
        torch.set_num_threads(args.threads)
        plain = plain_generation(hf, ckpt, args.prompt_tokens, args.max_tokens, max(3, args.rounds))
        print("plain generation in-process, tok/s:", {n: round(v, 1) for n, v in plain.items()}, flush=True)
    procs = {}
    try:
        for name, cmd in servers.items():
            procs[name] = start(cmd, ports[name], env)
        urls = {n: f"http://127.0.0.1:{ports[n]}" for n in servers}
        models = {"tformer": "tformer", "transformers": str(hf), "transformers-cb": str(hf)}
        prompt = " ".join(f"w{i}" for i in range(1, args.prompt_tokens + 1))
        texts = {n: httpx.post(urls[n] + "/v1/completions", timeout=600, json={
            "model": models[n], "prompt": prompt, "max_tokens": 16, "temperature": 0}).json()["choices"][0]["text"].strip()
            for n in servers}
        same = len(set(texts.values())) == 1
        print(f"greedy text identical across servers: {same}  ({texts})")
        busy_before = busy_cores()
        rows = []
        for level, streams in enumerate(int(s) for s in args.streams.split(",")):
            got = {n: [] for n in servers}
            for r in range(args.rounds):
                k = (level + r) % len(servers)
                order = list(servers)[k:] + list(servers)[:k]            # rotate who goes first
                for n in order:
                    got[n].append(round_(urls[n], models[n], streams, args.prompt_tokens, args.max_tokens,
                                         random.Random(1000 * level + r)))
            for n in servers:
                lat = [x for g in got[n] for x in g["latencies"]]
                gaps = [x for g in got[n] for x in g["gaps"]]
                tps = statistics.median(g["tokens_per_s"] for g in got[n])
                rows.append((streams, n, tps, pct(lat, 50), pct(lat, 99), pct(gaps, 50) * 1e3, pct(gaps, 99) * 1e3))
                print(f"{streams:>3} streams  {n:<13} {tps:8.1f} tok/s  latency p50 {pct(lat, 50):6.2f} s "
                      f"p99 {pct(lat, 99):6.2f} s  token gap p50 {pct(gaps, 50) * 1e3:7.1f} ms p99 {pct(gaps, 99) * 1e3:7.1f} ms",
                      flush=True)
            write(rows, args, same, busy_before, None, plain)          # a partial table survives an interruption
        write(rows, args, same, busy_before, busy_cores(), plain)
    finally:
        for p in procs.values():
            p.terminate()
            p.wait(timeout=30)


def write(rows, args, same, busy_before, busy_after, plain) -> None:
    one = {n: tps for s, n, tps, *_ in rows if s == rows[0][0]}
    lines = [
        "# Serving: tformer serve vs transformers serve",
        "",
        f"GPT-2 shape, {args.layers} layers, random weights; {args.prompt_tokens} prompt tokens, up to "
        f"{args.max_tokens} generated per request, greedy, streaming; {args.rounds} rounds per level alternating "
        f"the servers; torch threads {args.threads}. Load before the timed rounds: {load_note(busy_before)}. "
        + (f"After: {load_note(busy_after)}." if busy_after is not None else "(Run still going or interrupted.)"),
        f"Greedy text of one prompt identical across servers: {same}.",
        "",
        f"| streams | server | tokens/s | × its {rows[0][0]} stream(s) | latency p50 (s) | p99 (s) | token gap p50 (ms) | p99 (ms) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for s, n, tps, l50, l99, g50, g99 in rows:
        lines.append(f"| {s} | {n} | {tps:.1f} | {tps / one[n]:.2f} | {l50:.2f} | {l99:.2f} | {g50:.1f} | {g99:.1f} |")
    tps_of = {(s, n): tps for s, n, tps, *_ in rows}
    for peer in dict.fromkeys(n for _, n, *_ in rows if n != "tformer"):
        ratios = [f"{s} streams: {tps_of[(s, 'tformer')] / tps_of[(s, peer)]:.2f}×"
                  for s, n, *_ in rows if n == "tformer" and (s, peer) in tps_of]
        lines += ["", f"tformer / {peer} total tokens/s: " + ", ".join(ratios) + "."]
    if plain:
        first = rows[0][0]
        lines += ["", f"Plain generation in this process (no server; batch 1, {args.prompt_tokens} + {args.max_tokens} "
                      f"tokens, medians): " + ", ".join(f"{n} {v:.1f} tok/s" for n, v in plain.items())
                  + f"; tformer / transformers {plain['tformer'] / plain['transformers']:.2f}×.",
                  f"Each server's {first}-stream tokens/s over its model's plain generation (what the server path "
                  f"keeps): " + ", ".join(f"{n} {tps_of[(first, n)] / plain['tformer' if n == 'tformer' else 'transformers']:.2f}"
                                          for n in dict.fromkeys(r[1] for r in rows) if (first, n) in tps_of) + "."]
    args.run.busy_before = busy_before
    if busy_after is not None:
        args.run.finish(busy_after)
    args.run.write(RESULTS / f"{args.name}.md", "\n".join(lines))
    if busy_after is None:
        return
    print("\n".join(lines))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for n in dict.fromkeys(r[1] for r in rows):
        pts = [(s, tps) for s, n2, tps, *_ in rows if n2 == n]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=n)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("generated tokens/s (all streams)")
    ax.set_title(f"GPT-2 {args.layers}-layer shape on CPU, greedy streaming")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{args.name}.png", dpi=120)


if __name__ == "__main__":
    main()
