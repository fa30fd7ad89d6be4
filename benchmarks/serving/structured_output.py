"""Structured output on the real model: schema-valid JSON on 50 of 50 requests for each of 3 schemas.

`tformer serve --model smollm2` (SmolLM2-135M-Instruct, its Q4_1 GGUF imported), in this process on
a free loopback port, 16 slots, --max-model-len 512; the official `openai` client sends 50 chat
requests at once per schema with ``response_format: {"type": "json_schema", ...}``, sampled at
temperature 1 with seeds 0..49 (so the 50 answers differ; greedy would give one answer 50 times).
Criterion, fixed before the run (issue 27's "done when"): every one of the 150 answers ends with
``finish_reason: "stop"`` and validates against its schema with the `jsonschema` package (an
implementation independent of the grammar engine that constrained the output).

    flock -w 900 /tmp/tformer-bench.lock timeout 300 env PYTHONPATH=src python benchmarks/serving/structured_output.py [N]

Writes benchmarks/results/serving/structured_output.md. The schemas and the client are in
tests/serve/structured_util.py, which tests/serve/test_serve_smollm2_api.py runs with fewer requests.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # benchmarks/, for common/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1].parent / "tests" / "serve"))   # serve_util.Running
    from common.record import Run, results_dir
    record = Run()
    from serve_util import Running
    from structured_util import MAX_TOKENS, SCHEMAS, ask, valid
    from tformer.serve.build import build_server
    from tformer.serve.app import build_app

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 50
    server = build_server("smollm2", slots=16, max_queue=64, max_model_len=512)
    running = Running(build_app(server, api_key="sk-bench"))
    rows, examples = [], []
    try:
        for name, (schema, _) in SCHEMAS.items():
            start = time.monotonic()
            answers = asyncio.run(ask(running.url, "sk-bench", name, n))
            seconds = time.monotonic() - start
            texts = [a.choices[0].message.content for a in answers]
            ok = sum(valid(a, schema) for a in answers)
            tokens = sorted(a.usage.completion_tokens for a in answers)
            rows.append(f"| {name} | {ok} / {n} | {len(set(texts))} | {tokens[len(tokens) // 2]} | {tokens[-1]} | "
                        f"{seconds:.1f} |")
            examples.append(f"- {name}: `{texts[0]}`, `{texts[1]}`")
            print(rows[-1], flush=True)
        slots = server.metrics.value("tformer_pool_slots_in_use")
    finally:
        running.stop()
    text = "\n".join([
        "# Structured output on SmolLM2-135M-Instruct: schema-valid JSON, 3 schemas", "",
        f"{n} concurrent chat requests per schema through the `openai` client, `response_format` json_schema, "
        f"temperature 1, seeds 0..{n - 1}, max_tokens {MAX_TOKENS}, 16 slots. Valid: finish_reason \"stop\" and "
        f"`jsonschema.validate` passes. Criterion (set before the run): {n} of {n} for every schema.", "",
        "| schema | valid | distinct answers | median tokens | most tokens | seconds (all requests) |",
        "|---|---|---|---|---|---|", *rows, "",
        f"Slots in use after the load: {slots:g}.", "", "Two answers of each:", "", *examples, ""])
    record.finish()
    print(record.write(results_dir("serving") / "structured_output.md", text))


if __name__ == "__main__":
    main()
