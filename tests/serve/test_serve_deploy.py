"""What a deployment relies on (issue 27): the API key, the full queue, --max-model-len, a client that
leaves a full (non-streamed) response, graceful SIGTERM, the structured-output hook of the scheduler,
and all of it under 40 concurrent clients without a leaked slot.

The tiny random checkpoint of serve_util keeps every test in seconds; the real model's structured
output is tested in test_serve_smollm2_api.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from serve_util import Running, tiny_checkpoint
from tformer.cli import main
from tformer.serve.build import build_server
from tformer.serve.app import build_app
from tformer.serve.scheduler import Params, Scheduler, Sequence, Token

KEY = "sk-deploy-test"
JSON = {"content-type": "application/json"}


def auth(key=KEY) -> dict:
    return {**JSON, "authorization": f"Bearer {key}"}


def openai_error(r, status) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err


def settled(url: str, headers=None, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        h = httpx.get(url + "/health", timeout=5, headers=headers).json()
        if (h["running"] == 0 and h["waiting"] == 0) or time.monotonic() > deadline:
            return h
        time.sleep(0.05)


@pytest.fixture(scope="module")
def keyed(tmp_path_factory, one_thread):
    folder = tmp_path_factory.mktemp("ckpt")
    model, tok = tiny_checkpoint(folder, context=1024)
    server = build_server(str(folder), slots=4, max_queue=8)
    running = Running(build_app(server, api_key=KEY))
    yield server, running
    running.stop()


# ------------------------------------------------------------------------------ the API key
def test_every_route_but_health_needs_the_key(keyed):
    server, running = keyed
    assert httpx.get(running.url + "/health").status_code == 200
    body = json.dumps({"model": server.name, "prompt": "ab", "max_tokens": 2}).encode()
    for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/"), ("GET", "/static/app.js"),
                         ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/v1/inspect"),
                         ("POST", "/v1/embeddings")):
        for headers in (JSON, auth("sk-wrong"), auth(KEY + "x"), {**JSON, "authorization": KEY},
                        {**JSON, "authorization": "Basic " + KEY}):
            r = httpx.request(method, running.url + path, content=body if method == "POST" else None, headers=headers)
            assert openai_error(r, 401)["code"] == "invalid_api_key", (path, headers)
    assert httpx.get(running.url + "/v1/models", headers=auth()).json()["data"][0]["id"] == server.name
    r = httpx.post(running.url + "/v1/completions", content=body, headers=auth())
    assert r.status_code == 200 and len(r.json()["choices"][0]["text"]) == 2
    assert server.metrics.value("tformer_requests_total", status="401") >= 40


def test_the_openai_client_with_and_without_the_key(keyed):
    openai = pytest.importorskip("openai")
    server, running = keyed
    bad = openai.OpenAI(base_url=running.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=running.url + "/v1", api_key=KEY, max_retries=0)
    stream = good.completions.create(model=server.name, prompt="ab", max_tokens=5, temperature=0, stream=True)
    assert len("".join(c.choices[0].text for c in stream if c.choices)) == 5


def test_the_key_is_compared_in_constant_time(monkeypatch, keyed):
    """The check goes through hmac.compare_digest (a == would return at the first differing byte)."""
    import hmac

    from tformer.serve import app as app_module

    calls, real = [], hmac.compare_digest
    monkeypatch.setattr(app_module.hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    _, running = keyed
    assert httpx.get(running.url + "/v1/models", headers=auth("sk-guess")).status_code == 401
    assert calls == [(b"sk-guess", KEY.encode())]


def test_an_empty_key_is_refused_and_the_env_key_is_used(tmp_path, capsys, monkeypatch):
    tiny_checkpoint(tmp_path)
    assert main(["serve", "--ckpt", str(tmp_path), "--port", "0", "--api-key", " "]) == 2
    assert "API key is empty" in capsys.readouterr().err
    monkeypatch.setenv("TFORMER_API_KEY", "")
    assert main(["serve", "--ckpt", str(tmp_path), "--port", "0"]) == 2
    assert "TFORMER_API_KEY" in capsys.readouterr().err
    for bad in (["--max-model-len", "0"], ["--max-model-len", "65"], ["--shutdown-timeout", "-1"]):
        monkeypatch.delenv("TFORMER_API_KEY")
        assert main(["serve", "--ckpt", str(tmp_path), "--port", "0", *bad]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and bad[0] in err, err
        monkeypatch.setenv("TFORMER_API_KEY", "x")


# ------------------------------------------------------------------------------ --max-model-len
def test_max_model_len_bounds_prompt_and_completion(tmp_path, one_thread):
    tiny_checkpoint(tmp_path, context=64)
    server = build_server(str(tmp_path), slots=2, max_model_len=16)
    assert server.max_len == 16 and server.scheduler.pool.max_len == 16
    running = Running(build_app(server))
    try:
        base = {"model": server.name, "temperature": 0}
        err = openai_error(httpx.post(running.url + "/v1/completions", json={**base, "prompt": "abcd", "max_tokens": 13}), 400)
        assert err["code"] == "context_length_exceeded" and "16" in err["message"]
        r = httpx.post(running.url + "/v1/completions", json={**base, "prompt": "abcd", "max_tokens": 12})
        assert r.status_code == 200 and len(r.json()["choices"][0]["text"]) == 12
        err = openai_error(httpx.post(running.url + "/v1/completions", json={**base, "prompt": "abcd"}), 400)
        assert "at most 12" in err["message"]               # completions' default of 16 does not fit: say what does
        r = httpx.post(running.url + "/v1/chat/completions", json={**base, "messages": [{"role": "user", "content": "ab"}]})
        assert r.status_code == 200 and r.json()["usage"]["total_tokens"] == 16     # chat's default: what fits
    finally:
        running.stop()


# ------------------------------------------------------------------------------ disconnects
def slow_decode(server, seconds=0.01):
    real = server.scheduler.pool.decode

    def decode(*args, **kwargs):
        time.sleep(seconds)
        return real(*args, **kwargs)
    return decode


def test_a_client_that_leaves_a_full_response_frees_its_slot_at_once(keyed, monkeypatch):
    """Not streamed: the server watches for the disconnect itself (ASGI http.disconnect), so the
    sequence is cancelled within a step, not when it would have finished 1000 tokens later."""
    server, running = keyed
    monkeypatch.setattr(server.scheduler.pool, "decode", slow_decode(server))         # 1000 steps: >= 10 s
    before = server.metrics.value("tformer_sequences_total", reason="disconnect")
    made = server.metrics.value("tformer_generated_tokens_total")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(running.url + "/v1/completions", headers=auth(), timeout=0.5,
                   json={"model": server.name, "prompt": "ab", "max_tokens": 1000, "temperature": 0})
    h = settled(running.url, timeout=5)
    assert h["running"] == 0 and h["free_slots"] == 4, h
    assert server.metrics.value("tformer_sequences_total", reason="disconnect") == before + 1
    assert server.metrics.value("tformer_generated_tokens_total") - made < 500


# ------------------------------------------------------------------------------ the constraint hook
class OnlyThese:
    """A stand-in constraint: allows ``ids`` only, and records what it was fed."""

    def __init__(self, ids, fail_after=None):
        self.ids, self.fed, self.fail_after = list(ids), [], fail_after

    def mask(self, row):
        if self.fail_after is not None and len(self.fed) >= self.fail_after:
            raise RuntimeError("grammar broke")
        keep = torch.zeros_like(row, dtype=torch.bool)
        keep[self.ids] = True
        row.masked_fill_(~keep, float("-inf"))

    def advance(self, token):
        self.fed.append(token)


def test_the_scheduler_masks_constrained_rows_only(tmp_path, one_thread):
    """Greedy and sampled constrained rows pick only allowed tokens and feed each to the constraint;
    an unconstrained row in the same batch gets its plain greedy tokens; a constraint that raises
    fails its own request (500) and nobody else's."""
    from tformer.generation.generate import generate

    model, tok = tiny_checkpoint(tmp_path)
    allowed = [3, 7, 11]
    want = generate(model, torch.tensor([[1, 2, 3]]), 12, temperature=0)[0, 3:].tolist()
    scheduler = Scheduler(model, n_slots=4, max_queue=8)
    out = {k: [] for k in ("greedy", "sampled", "plain", "broken")}
    done = threading.Semaphore(0)

    def emitter(k):
        def emit(e):
            out[k].append(e)
            if isinstance(e, tuple):
                done.release()
        return emit
    cons = {"greedy": OnlyThese(allowed), "sampled": OnlyThese(allowed), "broken": OnlyThese(allowed, fail_after=2)}
    try:
        for k, params in (("greedy", Params(12, temperature=0.0)), ("sampled", Params(12, temperature=1.5, seed=3)),
                          ("plain", Params(12, temperature=0.0)), ("broken", Params(12, temperature=0.0))):
            scheduler.submit(Sequence([1, 2, 3], params, emitter(k), tok, constraint=cons.get(k)))
        for _ in out:
            assert done.acquire(timeout=30)
        ids = {k: [e.id for e in v if isinstance(e, Token) and e.id >= 0] for k, v in out.items()}
        for k in ("greedy", "sampled"):
            assert len(ids[k]) == 12 and set(ids[k]) <= set(allowed) and cons[k].fed == ids[k]
        assert len(set(ids["sampled"])) > 1                   # really sampled among the allowed
        assert ids["plain"] == want and not set(want) <= set(allowed)
        assert out["broken"][-1][0] == "error" and out["broken"][-1][2] == 500 and len(ids["broken"]) == 2
        assert scheduler.metrics.value("tformer_pool_slots_in_use") == 0
    finally:
        scheduler.close()


def test_structured_output_on_a_character_vocabulary_is_a_clear_400(keyed, monkeypatch):
    from tformer.serve import grammar

    server, running = keyed
    body = {"model": server.name, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_object"}}
    if grammar.available():
        err = openai_error(httpx.post(running.url + "/v1/chat/completions", json=body, headers=auth()), 400)
        assert "CharTokenizer" in err["message"] and err["param"] == "response_format"
    monkeypatch.setattr(grammar, "available", lambda: False)
    err = openai_error(httpx.post(running.url + "/v1/chat/completions", json=body, headers=auth()), 400)
    assert "pip install 'tformer[grammar]'" in err["message"]
    r = httpx.post(running.url + "/v1/chat/completions", json={**body, "response_format": {"type": "text"}},
                   headers=auth())
    assert r.status_code == 200


# ------------------------------------------------------------------------------ 40 clients
def test_forty_clients_keys_garbage_full_queue_and_disconnects(keyed, monkeypatch):
    """40 clients at once on 4 slots and 8 queue places, each: no key (401), a wrong key (401),
    malformed JSON (400), tools or a bad response_format (400), one real request (200, or 429 when the
    queue is full: then retried, as OpenAI's clients do), and every fourth leaves a stream early.
    After it all, nothing is running or waiting and no slot is held."""
    server, running = keyed
    monkeypatch.setattr(server.scheduler.pool, "decode", slow_decode(server, 0.002))
    url, name = running.url, server.name
    failures, served, full = [], [], []
    good = {"model": name, "max_tokens": 8, "temperature": 0}

    async def expect(client, path, status, content, headers):
        r = await client.post(url + path, content=content, headers=headers)
        err = r.json().get("error", {}) if r.headers.get("content-type", "").startswith("application/json") else {}
        if r.status_code != status or set(err) != {"message", "type", "param", "code"}:
            failures.append((path, status, r.status_code, r.text[:120]))

    async def one(client, i):
        chat = json.dumps({**good, "messages": [{"role": "user", "content": "a"}],
                           "tools": [{"type": "function", "function": {"name": "f"}}]}).encode()
        bad_format = json.dumps({**good, "messages": [{"role": "user", "content": "a"}],
                                 "response_format": {"type": "json_schema"}}).encode()
        await expect(client, "/v1/completions", 401, json.dumps({**good, "prompt": "ab"}).encode(), JSON)
        await expect(client, "/v1/chat/completions", 401, chat, auth("wrong"))
        await expect(client, "/v1/completions", 400, b'{"model": ', auth())
        await expect(client, "/v1/chat/completions", 400, chat if i % 2 else bad_format, auth())
        body = {**good, "prompt": f"x{i}", "stream": i % 2 == 0}
        for _ in range(50):
            if i % 4 == 0:                                        # leaves after the first chunk
                async with client.stream("POST", url + "/v1/completions", json={**body, "max_tokens": 500},
                                         headers=auth()) as r:
                    if r.status_code == 429:
                        full.append(i)
                        await asyncio.sleep(0.05)
                        continue
                    async for _line in r.aiter_lines():
                        break
                served.append(i)
                return
            r = await client.post(url + "/v1/completions", json=body, headers=auth())
            if r.status_code == 429:
                full.append(i)
                assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "rate_limit_exceeded"
                await asyncio.sleep(0.05)
                continue
            if r.status_code != 200 or ("[DONE]" not in r.text if body["stream"] else
                                        len(r.json()["choices"][0]["text"]) != 8):
                failures.append((i, r.status_code, r.text[:120]))
            served.append(i)
            return
        failures.append((i, "queue full 50 times"))

    async def flood():
        limits = httpx.Limits(max_connections=80, max_keepalive_connections=0)
        async with httpx.AsyncClient(limits=limits, timeout=60) as client:
            await asyncio.gather(*(one(client, i) for i in range(40)))

    asyncio.run(flood())
    assert failures == []
    assert sorted(served) == list(range(40))
    assert full, "40 clients on 4 slots + 8 queue places never filled the queue"
    h = settled(url, timeout=30)
    assert h["status"] == "ok" and h["running"] == h["waiting"] == 0 and h["free_slots"] == 4, h
    metrics = httpx.get(url + "/metrics", headers=auth()).text
    assert "tformer_pool_slots_in_use 0" in metrics and "tformer_queue_length 0" in metrics


# ------------------------------------------------------------------------------ SIGTERM
def start_server(ckpt, *extra):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "tformer", "serve", "--ckpt", ckpt, "--port", "0", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    m = re.search(r"http://([\d.]+):(\d+)/", line)
    assert m, (line, proc.stderr.read() if proc.poll() is not None else "")
    return proc, f"http://{m.group(1)}:{m.group(2)}"


@pytest.mark.parametrize("grace", [30.0, 0.3])
def test_sigterm_finishes_or_ends_the_running_streams(tmp_path, grace):
    """SIGTERM mid-stream: with time to spare (grace 30 s) the stream runs to its last token and
    [DONE]; with 0.3 s it is ended with a "shutting down" error chunk; either way the process exits 0
    soon after (uvicorn stops accepting connections at once)."""
    tiny_checkpoint(tmp_path, context=4096)
    proc, url = start_server(str(tmp_path), "--shutdown-timeout", str(grace), "--slots", "2")
    try:
        n = 400 if grace > 1 else 4000
        body = {"model": tmp_path.name, "prompt": "ab", "max_tokens": n, "temperature": 0, "stream": True}
        tokens, tail = 0, []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if tokens == 2:
                    proc.send_signal(signal.SIGTERM)
                    sent = time.monotonic()
                if line.startswith("data: {") and '"text":"' in line and '"finish_reason":null' in line:
                    tokens += 1
                tail.append(line)
        assert proc.wait(timeout=grace + 15) == 0
        assert time.monotonic() - sent < grace + 10
    finally:
        if proc.poll() is None:
            proc.kill()
    if grace > 1:
        assert tail[-1] == "data: [DONE]" and '"finish_reason":"length"' in tail[-2] and tokens == n
    else:
        assert any("shutting down" in line for line in tail[-3:]) and tokens < n, tail[-3:]


def test_a_draining_server_refuses_new_work_and_says_so(keyed):
    server, running = keyed
    server.draining = True
    try:
        h = httpx.get(running.url + "/health")
        assert h.status_code == 503 and h.json()["status"] == "draining"
        r = httpx.post(running.url + "/v1/completions", headers=auth(), json={"model": server.name, "prompt": "a"})
        assert openai_error(r, 503)["code"] == "server_shutting_down"
    finally:
        server.draining = False
    assert httpx.get(running.url + "/health").status_code == 200
