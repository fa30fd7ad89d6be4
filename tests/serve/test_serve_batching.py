"""Continuous batching is exact, and the server survives bad clients and load without leaking slots.

Exactness reference: tformer.generation.generate (one request at a time, its own KV cache) on a
separate copy of the model; the scheduler must give every request the same greedy tokens alone and
among 15 others of different prompt lengths and output lengths (which join and leave mid-batch).
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time

import httpx
import pytest
import torch

from tformer.generation.generate import generate

from serve_util import Running, tiny_checkpoint
from tformer.serve.build import build_server
from tformer.serve.app import build_app
from tformer.serve.scheduler import Params, Scheduler, Sequence, Token


def run_together(scheduler, tokenizer, prompts, max_tokens) -> list[list[int]]:
    """Submit every prompt at once; return each one's generated tokens."""
    out = [[] for _ in prompts]
    done = threading.Semaphore(0)

    def emitter(i):
        def emit(event):
            if isinstance(event, Token):
                if event.id >= 0:
                    out[i].append(event.id)
            else:
                done.release()
        return emit
    for i, (p, n) in enumerate(zip(prompts, max_tokens)):
        scheduler.submit(Sequence(p, Params(n, temperature=0.0), emitter(i), tokenizer))
    for _ in prompts:
        assert done.acquire(timeout=60)
    return out


@pytest.mark.parametrize("context, positions, options", [
    (64, "learned", {}), (64, "rope", {"n_kv_heads": 2}), (64, "alibi", {}), (64, "rope", {"sliding_window": 8}),
    (200, "learned", {}),                       # rows cross the decode step's 64-key buckets at 64 and 128
    (64, "none", {"mixer": ["mamba", "attention"]})])   # a recurrent state: prompts prefilled one at a time
def test_batched_greedy_tokens_equal_each_request_alone(tmp_path, one_thread, context, positions, options):
    model, tok = tiny_checkpoint(tmp_path, context=context, positions=positions, **options)
    reference_model = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, tok.vocab_size, (int(n),), generator=g).tolist()
               for n in torch.randint(1, context // 2, (16,), generator=g)]
    max_tokens = [int(n) for n in torch.randint(5, context // 2, (16,), generator=g)]
    reference = [generate(reference_model, torch.tensor([p]), n, temperature=0)[0, len(p):].tolist()
                 for p, n in zip(prompts, max_tokens)]
    scheduler = Scheduler(model, n_slots=8, max_queue=16, prefill_per_step=3)   # 16 requests > 8 slots: a queue
    try:
        alone = [run_together(scheduler, tok, [p], [n])[0] for p, n in zip(prompts, max_tokens)]
        together = run_together(scheduler, tok, prompts, max_tokens)
        b, counts, _ = scheduler.metrics.hists["tformer_batch_size"]
        assert sum(counts[b.index(4) + 1:]) > 0              # some steps really decoded more than 4 rows
        b, counts, _ = scheduler.metrics.hists["tformer_prefill_batch_size"]
        assert scheduler.pool.batched_prefill == (positions != "none")
        if scheduler.pool.batched_prefill:                   # prompts of different lengths, right-padded together
            assert sum(counts[b.index(1) + 1:]) > 0
        assert scheduler.metrics.value("tformer_pool_slots_in_use") == 0
    finally:
        scheduler.close()
    assert alone == reference
    assert together == reference
    assert len({tuple(r) for r in reference}) > 8           # the test model does not repeat one answer


@pytest.fixture(scope="module")
def long_server(tmp_path_factory, one_thread):
    folder = tmp_path_factory.mktemp("ckpt-long")
    tiny_checkpoint(folder, context=1024)
    server = build_server(str(folder), slots=8, max_queue=32)
    running = Running(build_app(server))
    yield server, running
    running.stop()


def settled(url: str, timeout: float = 20.0) -> dict:
    """/health once nothing is running or waiting (or after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        h = httpx.get(url + "/health", timeout=5).json()
        if (h["running"] == 0 and h["waiting"] == 0) or time.monotonic() > deadline:
            return h


def test_disconnects_and_slow_readers_free_their_slots(long_server):
    server, running = long_server
    body = {"model": server.name, "prompt": "abc", "max_tokens": 1000, "temperature": 0, "stream": True}
    for _ in range(5):                                            # leave after two chunks
        with httpx.stream("POST", running.url + "/v1/completions", json=body, timeout=30) as r:
            for i, _line in enumerate(r.iter_lines()):
                if i >= 2:
                    break
    with httpx.stream("POST", running.url + "/v1/completions", json={**body, "max_tokens": 200}, timeout=30) as r:
        lines = []
        for line in filter(None, r.iter_lines()):                  # a slow reader: the server waits for nobody
            lines.append(line)
            if len(lines) == 3:
                time.sleep(1.0)
                assert httpx.get(running.url + "/health", timeout=5).json()["status"] == "ok"
    assert lines[-1] == "data: [DONE]"
    h = settled(running.url)
    assert h["free_slots"] == h["slots"] == 8
    assert server.metrics.value("tformer_sequences_total", reason="disconnect") >= 1
    assert server.metrics.value("tformer_pool_slots_in_use") == 0


def test_two_hundred_connections_and_garbage(long_server):
    server, running = long_server
    url = running.url + "/v1/completions"

    async def one(client, i):
        kind = i % 4
        if kind == 0:
            r = await client.post(url, content=b'{"model": ',                         # malformed JSON
                                  headers={"content-type": "application/json"})
        elif kind == 1:
            r = await client.post(url, json={"model": server.name, "prompt": ["a", 3], "max_tokens": 2})
        else:
            r = await client.post(url, json={"model": server.name, "prompt": "x" * (i % 50 + 1), "max_tokens": 8,
                                             "stream": kind == 3})
        return r.status_code

    async def flood():
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
        async with httpx.AsyncClient(limits=limits, timeout=60) as client:
            return await asyncio.gather(*(one(client, i) for i in range(200)))

    statuses = asyncio.run(flood())
    assert statuses.count(400) == 100                                              # the garbage half
    assert set(statuses) <= {200, 400, 429} and statuses.count(200) >= 8          # served, or told to retry (429)
    h = settled(running.url)
    assert h["status"] == "ok" and h["free_slots"] == 8
    metrics = httpx.get(running.url + "/metrics").text
    assert "tformer_pool_slots_in_use 0" in metrics and "tformer_queue_length 0" in metrics


def test_queue_limit_and_request_timeout(tmp_path, one_thread):
    """A full queue refuses at once (the app answers 429); a request that outwaits its timeout in the
    queue gets an error; one that runs out of time while generating ends with "length"."""
    from tformer.serve.scheduler import QueueFull

    model, tok = tiny_checkpoint(tmp_path)
    scheduler = Scheduler(model, n_slots=1, max_queue=1)
    events = []
    try:
        gate = threading.Event()
        scheduler.run_job(gate.wait)                        # hold the scheduler so nothing is admitted
        waiting = Sequence([1, 2], Params(5, temperature=0.0), events.append, tok, timeout=0.05)
        scheduler.submit(waiting)
        with pytest.raises(QueueFull):
            scheduler.submit(Sequence([1, 2], Params(5), events.append, tok))
        time.sleep(0.1)
        gate.set()
        deadline = time.monotonic() + 10
        while not events and time.monotonic() < deadline:
            time.sleep(0.01)
        assert events[0][0] == "error" and "waited" in events[0][1]
        events.clear()
        def out_of_time_after_first_token(event):           # runs on the scheduler thread
            events.append(event)
            slow.timeout = 0.0
        slow = Sequence([1, 2], Params(50, temperature=0.0), out_of_time_after_first_token, tok)
        scheduler.submit(slow)
        while not (events and isinstance(events[-1], tuple)) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert events[-1] == ("done", "length") and sum(isinstance(e, Token) for e in events) <= 2
        assert scheduler.metrics.value("tformer_pool_slots_in_use") == 0
    finally:
        scheduler.close()


def test_batch_choice_equals_each_row_alone():
    """choose() on a batch of rows with different options gives each row what it gets alone, and its
    log-probabilities equal torch.log_softmax's (reference) to 1e-6."""
    from tformer.serve.sampling import choose

    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 3
    params = [Params(1, temperature=0.0), Params(1, temperature=0.7, seed=1, logprobs=3), Params(1, top_k=5, seed=2),
              Params(1, temperature=0.0, logprobs=0), Params(1, temperature=0.7, seed=3), Params(1, top_p=0.5, logprobs=5)]
    gens = lambda: [torch.Generator().manual_seed(p.seed or 0) for p in params]    # noqa: E731
    together = choose(logits, params, gens())
    alone = [choose(logits[i:i + 1], [p], [g])[0] for i, (p, g) in enumerate(zip(params, gens()))]
    assert together == alone
    assert together[0][0] == int(logits[0].argmax()) and together[3][0] == int(logits[3].argmax())
    for i in (1, 3, 5):
        tok, lp, top = together[i]
        ref = torch.log_softmax(logits[i].double(), -1)
        assert abs(lp - float(ref[tok])) < 1e-6
        assert (top is None) == (params[i].logprobs == 0)
        if top:
            assert [t for t, _ in top] == ref.topk(params[i].logprobs).indices.tolist()
            assert max(abs(v - float(ref[t])) for t, v in top) < 1e-6
