"""Nothing a client sends can stop the server (issue 29, items 1, 2, 6, 7, 16).

Each test drives a real uvicorn server on 127.0.0.1 (or the scheduler directly) with what a new user
or a hostile client sends, and checks the answer's status and OpenAI error body, then that the
server still answers and holds no slot. Reference for the answers that must be right: greedy text
from tformer.generation.text.generate_text (one request alone, its own KV cache).
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from serve_util import CHARS, Running, tiny_checkpoint
from tformer.serve.build import build_server
from tformer.errors import ConfigError
from tformer.generation.text import generate_text
from tformer.serve.app import build_app
from tformer.serve.scheduler import Params, Scheduler, Sequence, Token


@pytest.fixture(scope="module")
def served(tmp_path_factory, one_thread):
    folder = tmp_path_factory.mktemp("ckpt")
    model, tok = tiny_checkpoint(folder)
    server = build_server(str(folder), slots=4, max_queue=8)
    running = Running(build_app(server))
    yield model, tok, server, running
    running.stop()


def post(running, path, body, **kw):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = kw.pop("headers", {"content-type": "application/json"})
    return httpx.post(running.url + path, content=content, headers=headers, timeout=60, **kw)


def assert_openai_error(r, status):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err


def assert_idle(server, running):
    deadline = time.monotonic() + 20
    while True:
        h = httpx.get(running.url + "/health", timeout=5)
        if h.status_code == 200 and h.json()["running"] == h.json()["waiting"] == 0:
            break
        assert time.monotonic() < deadline, h.text
        time.sleep(0.05)
    assert h.json()["free_slots"] == h.json()["slots"]
    assert "tformer_pool_slots_in_use 0" in httpx.get(running.url + "/metrics").text


# ------------------------------------------------------------------------------ item 1
def test_a_denormal_temperature_is_greedy_and_the_server_goes_on(served):
    model, tok, server, running = served
    body = {"model": server.name, "prompt": "ROMEO:", "max_tokens": 4, "temperature": 1e-45}
    r = post(running, "/v1/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == generate_text(model, tok, "ROMEO:", 4, temperature=0)
    r = post(running, "/v1/completions", {**body, "temperature": 0.5, "seed": 1})        # the next one answers
    assert r.status_code == 200 and len(r.json()["choices"][0]["text"]) == 4
    assert_idle(server, running)


def wait_events(events, n, timeout=30):
    deadline = time.monotonic() + timeout
    while sum(isinstance(e, tuple) for e in events) < n:
        assert time.monotonic() < deadline, events
        time.sleep(0.01)


@pytest.mark.parametrize("where", ["decode", "prefill"])
def test_a_step_that_raises_fails_its_requests_only(tmp_path, one_thread, monkeypatch, where, capsys):
    """The watchdog: the model call raises once; the sequences of that step get a 500 event, their
    slots come back, the loop lives, and the next request gets its full greedy answer."""
    model, tok = tiny_checkpoint(tmp_path)
    scheduler = Scheduler(model, n_slots=2, max_queue=4)
    try:
        real = getattr(scheduler.pool, where)
        calls = {"n": 0}

        def once(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("injected fault")
            return real(*args, **kwargs)
        monkeypatch.setattr(scheduler.pool, where, once)
        first, second = [], []
        scheduler.submit(Sequence(tok.encode("ab"), Params(5, temperature=0.0), first.append, tok))
        wait_events(first, 1)
        assert first[-1][0] == "error" and first[-1][2] == 500 and "injected fault" in first[-1][1]
        assert scheduler.thread.is_alive()
        scheduler.submit(Sequence(tok.encode("ab"), Params(5, temperature=0.0), second.append, tok))
        wait_events(second, 1)
        assert second[-1] == ("done", "length")
        got = "".join(e.text for e in second if isinstance(e, Token))
        assert got == generate_text(model, tok, "ab", 5, temperature=0)
        assert scheduler.metrics.value("tformer_step_errors_total") == 1
        assert scheduler.metrics.value("tformer_pool_slots_in_use") == 0 and len(scheduler.free) == 2
        assert "injected fault" in capsys.readouterr().err                      # the operator sees the traceback
    finally:
        scheduler.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")    # the SystemExit, on purpose
def test_a_stopped_scheduler_refuses_instead_of_hanging(tmp_path, one_thread, monkeypatch):
    """Only an interpreter exit (a BaseException) ends the loop: the held request is told, and later
    submissions are refused at once (a 503 from the app) rather than queued for nobody."""
    from tformer.serve.scheduler import QueueFull

    model, tok = tiny_checkpoint(tmp_path)
    scheduler = Scheduler(model, n_slots=1, max_queue=4)

    def exit_now(*args, **kwargs):
        raise SystemExit(0)
    monkeypatch.setattr(scheduler.pool, "decode", exit_now)
    events = []
    scheduler.submit(Sequence(tok.encode("ab"), Params(5, temperature=0.0), events.append, tok))
    wait_events(events, 1)
    assert events[-1][0] == "error" and events[-1][2] == 503
    scheduler.thread.join(10)
    with pytest.raises(QueueFull):
        scheduler.submit(Sequence(tok.encode("ab"), Params(5), events.append, tok))


# ------------------------------------------------------------------------------ items 2 and 7
def test_work_that_can_never_fit_is_a_400_before_anything_is_allocated(served, monkeypatch):
    _, _, server, running = served
    made = []
    monkeypatch.setattr(Sequence, "__post_init__", lambda self: made.append(1))      # counts allocations
    start = time.monotonic()
    r = post(running, "/v1/completions", {"model": server.name, "prompt": ["A"] * 20000, "n": 16, "max_tokens": 2})
    assert "at most 64" in assert_openai_error(r, 400)["message"]
    assert time.monotonic() - start < 5
    for body in ({"prompt": ["A"] * 9}, {"prompt": ["A"] * 5, "n": 2}, {"prompt": "A", "n": 9}):
        r = post(running, "/v1/completions", {"model": server.name, "max_tokens": 2, **body})
        assert assert_openai_error(r, 400)["param"] in ("n", "prompt")
    r = post(running, "/v1/chat/completions", {"model": server.name, "n": 9, "max_tokens": 2,
                                               "messages": [{"role": "user", "content": "a"}]})
    assert_openai_error(r, 400)
    assert made == []
    assert server.metrics.value("tformer_queue_length") == 0


def test_queue_limits(tmp_path, one_thread):
    """--max-queue 0 is refused at start; a full queue is one 429 (OpenAI's "retry later", with
    Retry-After), counted once; n=4 on a queue of 2
    is a 400 (it never fits); a request that fits waits for its turn."""
    model, tok = tiny_checkpoint(tmp_path)
    with pytest.raises(ConfigError, match="max-queue"):
        build_server(str(tmp_path), slots=1, max_queue=0)
    server = build_server(str(tmp_path), slots=1, max_queue=2)
    running = Running(build_app(server))
    try:
        body = {"model": server.name, "prompt": "ab", "max_tokens": 2, "temperature": 0}
        assert_openai_error(post(running, "/v1/completions", {**body, "n": 4}), 400)
        gate = threading.Event()
        server.scheduler.run_job(gate.wait)                          # hold the scheduler: nothing is admitted
        results = []
        threads = [threading.Thread(target=lambda: results.append(post(running, "/v1/completions", {**body, "n": 2})))]
        threads[0].start()
        deadline = time.monotonic() + 10
        while len(server.scheduler.waiting) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        before = server.metrics.value("tformer_requests_total", status="429")
        full = post(running, "/v1/completions", body)
        assert assert_openai_error(full, 429)["code"] == "rate_limit_exceeded" and full.headers["retry-after"] == "1"
        assert server.metrics.value("tformer_requests_total", status="429") == before + 1
        gate.set()
        threads[0].join(30)
        assert results[0].status_code == 200 and len(results[0].json()["choices"]) == 2
        assert_idle(server, running)
    finally:
        running.stop()


# ------------------------------------------------------------------------------ items 6 and 16
def test_bad_input_is_a_400_with_openai_body(served):
    _, _, server, running = served
    base = {"model": server.name, "max_tokens": 2}
    cases = [
        {**base, "prompt": "def f(x): {}"},                   # characters outside the vocabulary
        {**base, "prompt": "5 \u20ac"},
        {**base, "prompt": "a", "seed": 2**64},
        {**base, "prompt": "a", "seed": -(2**63) - 1},
        {**base, "prompt": "a", "temperature": True},
        {**base, "prompt": "a", "temperature": "0.5"},
        {**base, "prompt": "a", "top_p": "1"},
        {**base, "prompt": "a", "stream_options": {"include_usage": True}},        # without stream
    ]
    for body in cases:
        assert_openai_error(post(running, "/v1/completions", body), 400)
    lone_surrogate = b'{"model": "%s", "prompt": "a\\ud800", "max_tokens": 2}' % server.name.encode()
    assert_openai_error(post(running, "/v1/completions", lone_surrogate), 400)
    deep = b'{"model": "m", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert_openai_error(post(running, "/v1/completions", deep), 400)
    for ids, index in (([5, 10**6, 3], 2), ([-1, 3], 1), ([5, 3, 10**6], 2)):
        assert_openai_error(post(running, "/v1/inspect", {"prompt": "ab", "token_ids": ids, "index": index}), 400)
    r = post(running, "/v1/completions", {**base, "prompt": "a", "seed": 2**63 - 1, "n": 2, "temperature": 1.0})
    assert r.status_code == 200, r.text                        # the largest int64 seed, and seed + 1 wraps
    r = post(running, "/v1/completions", {**base, "prompt": "a", "seed": -5, "temperature": 1})
    assert r.status_code == 200, r.text                        # OpenAI's seed is signed; an int temperature is fine
    assert_idle(server, running)


def test_only_json_bodies_are_read(served):
    """A web page may post text/plain to any address without asking (no CORS preflight): refused."""
    _, _, server, running = served
    body = json.dumps({"model": server.name, "prompt": "a", "max_tokens": 2}).encode()
    for headers in ({"content-type": "text/plain"}, {"content-type": "application/x-www-form-urlencoded"}, {}):
        assert_openai_error(post(running, "/v1/completions", body, headers=headers), 415)
    r = post(running, "/v1/completions", body, headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200


def test_inspect_and_chat_on_unusual_models(tmp_path, one_thread):
    """/v1/inspect on a Mamba model (no attention weights: empty rows, attribution still given); chat
    with a character vocabulary that has no newline (messages end with a space instead)."""
    from tformer.tokenizers import CharTokenizer

    model, tok = tiny_checkpoint(tmp_path / "mamba", positions="none", mixer=["mamba", "attention"])
    server = build_server(str(tmp_path / "mamba"), slots=2)
    running = Running(build_app(server))
    try:
        r = post(running, "/v1/inspect", {"prompt": "ab c", "token_ids": [5, 9, 11], "index": 2})
        assert r.status_code == 200, r.text
        data = r.json()
        assert data["n_layers"] == 2 and data["attention"][0] == [] and len(data["attention"][1]) == 4
        assert len(data["attention"][1][0]) == 6 and abs(sum(data["attribution"]) - 1) < 1e-5
        assert len(data["logit_lens"]) == 3                              # the lens reads any mixer's stream
        r = post(running, "/v1/inspect", {"prompt": "ab c", "token_ids": [5, 9, 11], "index": 2, "ablate": [[0, 0]]})
        assert r.status_code == 400 and "not a softmax-attention layer" in r.json()["error"]["message"]
        r = post(running, "/v1/inspect", {"prompt": "ab c", "token_ids": [5, 9, 11], "index": 2, "ablate": [[1, 0]]})
        assert r.status_code == 200 and "ablation" in r.json()
    finally:
        running.stop()
    model, _ = tiny_checkpoint(tmp_path / "flat")
    flat = CharTokenizer([c for c in CHARS if c != "\n"])
    flat.save(tmp_path / "flat" / "tokenizer.json")
    server = build_server(str(tmp_path / "flat"), slots=2)
    running = Running(build_app(server))
    try:
        r = post(running, "/v1/chat/completions", {"model": server.name, "max_tokens": 3, "temperature": 0,
                                                   "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == generate_text(model, flat, "hi ", 3, temperature=0)
    finally:
        running.stop()


def test_embeddings_folder_is_checked_at_start(tmp_path):
    tiny_checkpoint(tmp_path / "lm")
    with pytest.raises(ConfigError, match="no-such-dir"):
        build_server(str(tmp_path / "lm"), embeddings=str(tmp_path / "no-such-dir"))
