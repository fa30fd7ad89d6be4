"""The server under 20 concurrent clients mixing good and bad requests, with a fault injected into
one decode step (issue 29's "done when").

Every good request must end with its exact greedy answer (reference: generate_text on a separate
copy of the model, one request alone); a request whose step the fault hit gets a 500 in OpenAI's
error shape and its client retries, as OpenAI's clients do. Every bad request gets its 4xx. After
it all, /health is 200 and /metrics shows no slot in use and exactly one failed step.
"""

from __future__ import annotations

import asyncio
import copy
import json

import httpx

from serve_util import Running, tiny_checkpoint
from tformer.serve.build import build_server
from tformer.generation.text import generate_text
from tformer.serve.app import build_app

JSON = {"content-type": "application/json"}


def test_twenty_clients_bad_requests_and_a_failing_step(tmp_path, one_thread, monkeypatch):
    model, tok = tiny_checkpoint(tmp_path)
    reference = copy.deepcopy(model)
    server = build_server(str(tmp_path), slots=4, max_queue=32)
    name = server.name
    prompts = [f"x{i}" + "ab" * (i % 5) for i in range(20)]
    want = {p: generate_text(reference, tok, p, 6, temperature=0) for p in prompts}

    real, calls = server.scheduler.pool.decode, {"n": 0}

    def decode_failing_once(*args, **kwargs):           # the 10th decode step raises, mid-run
        calls["n"] += 1
        if calls["n"] == 10:
            raise RuntimeError("injected fault in a decode step")
        return real(*args, **kwargs)
    monkeypatch.setattr(server.scheduler.pool, "decode", decode_failing_once)

    bad = [  # (body bytes, headers, path, expected status)
        (b'{"model": ', JSON, "/v1/completions", 400),
        (json.dumps({"model": name, "prompt": "5 \u20ac", "max_tokens": 2}).encode(), JSON, "/v1/completions", 400),
        (json.dumps({"model": name, "prompt": "a", "seed": 2**64}).encode(), JSON, "/v1/completions", 400),
        (json.dumps({"model": name, "prompt": ["a"] * 20000, "n": 16}).encode(), JSON, "/v1/completions", 400),
        (json.dumps({"model": name, "prompt": "a", "temperature": "0.5"}).encode(), JSON, "/v1/completions", 400),
        (b'{"model": "m", "prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", JSON, "/v1/completions", 400),
        (json.dumps({"model": name, "prompt": "a"}).encode(), {"content-type": "text/plain"}, "/v1/completions", 415),
        (json.dumps({"prompt": "a", "token_ids": [1, 10**6], "index": 1}).encode(), JSON, "/v1/inspect", 400),
        (json.dumps({"model": name, "prompt": "a", "max_tokens": 10**9}).encode(), JSON, "/v1/completions", 400),
        (json.dumps({"model": "gpt-4", "prompt": "a"}).encode(), JSON, "/v1/completions", 404),
    ]
    running = Running(build_app(server))
    results: dict[str, str] = {}
    failures: list[tuple] = []
    retried = []

    async def good(client, i):
        prompt = prompts[i]
        temperature = 1e-45 if i == 7 else 0                 # the denormal temperature: greedy
        stream = i % 3 == 0
        body = {"model": name, "prompt": prompt, "max_tokens": 6, "temperature": temperature, "stream": stream}
        for attempt in range(4):
            r = await client.post(running.url + "/v1/completions", json=body)
            text = r.text
            if r.status_code == 500 or (stream and '"server_error"' in text):
                assert "injected fault" in text, text
                retried.append(i)
                continue
            assert r.status_code == 200, text
            if stream:
                chunks = [json.loads(line[6:]) for line in text.splitlines()
                          if line.startswith("data: {")]
                results[prompt] = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
            else:
                results[prompt] = r.json()["choices"][0]["text"]
            return
        failures.append((i, "no answer after 4 attempts"))

    async def hostile(client, j):
        body, headers, path, status = bad[j % len(bad)]
        r = await client.post(running.url + path, content=body, headers=headers)
        err = r.json().get("error", {})
        if r.status_code != status or set(err) != {"message", "type", "param", "code"}:
            failures.append((j, r.status_code, r.text[:200]))

    async def client_task(client, c):                     # each client alternates bad and good requests
        await hostile(client, 2 * c)
        await good(client, c)
        await hostile(client, 2 * c + 1)

    async def main():
        limits = httpx.Limits(max_connections=40, max_keepalive_connections=0)
        async with httpx.AsyncClient(limits=limits, timeout=120) as client:
            await asyncio.gather(*(client_task(client, c) for c in range(20)))

    try:
        asyncio.run(main())
        assert failures == []
        assert results == want
        assert calls["n"] > 10 and 1 <= len(retried) <= 4    # the fault hit one step's batch (4 slots) only
        assert server.metrics.value("tformer_step_errors_total") == 1
        health = httpx.get(running.url + "/health", timeout=10)
        assert health.status_code == 200 and health.json()["free_slots"] == 4
        metrics = httpx.get(running.url + "/metrics", timeout=10).text
        assert "tformer_pool_slots_in_use 0" in metrics and "tformer_queue_length 0" in metrics
    finally:
        running.stop()
