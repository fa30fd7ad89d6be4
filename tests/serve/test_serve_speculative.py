"""The scheduler's speculative steps (a lone sequence, prompt-lookup or draft-model drafts verified in
one forward of its pool row) and its prefix cache give the tokens the plain scheduler gives; after a load of 40
concurrent clients sharing a system prompt no slot and no prefix block is held by a request."""

from __future__ import annotations

import asyncio
import copy
import time

import httpx
import pytest
import torch

from serve_util import Running, run_alone, tiny_checkpoint
from tformer.serve.build import build_server
from tformer.serve.app import build_app
from tformer.serve.scheduler import Scheduler


@pytest.mark.parametrize("positions", ["rope", "learned"])
def test_speculative_steps_give_plain_greedy_tokens(tmp_path, one_thread, positions):
    model, tok = tiny_checkpoint(tmp_path, context=128, positions=positions)
    with torch.no_grad():
        model.lm_head.weight.mul_(3)                                    # sharper: no greedy near-ties
    g = torch.Generator().manual_seed(4)
    base = [torch.randint(0, tok.vocab_size, (8,), generator=g).tolist() for _ in range(5)]
    prompts = [b * 3 for b in base]                                     # repeats: lookup drafts often
    plain = Scheduler(copy.deepcopy(model), n_slots=2)
    spec = Scheduler(model, n_slots=2, speculative=4, prefix_cache_mb=1)
    m = same_tokens_as_plain(spec, plain, tok, prompts, 40)
    assert m.value("tformer_speculative_accepted_tokens_total") > 0
    assert m.value("tformer_speculative_steps_total") < 5 * 39      # fewer forwards than tokens


def same_tokens_as_plain(spec, plain, tok, prompts, n):
    """Each prompt alone through both schedulers, greedy: equal tokens; then one sampled request on
    ``spec`` (n valid tokens) and no slot held. Closes both; returns ``spec``'s metrics."""
    try:
        for p in prompts:
            assert run_alone(spec, tok, p, n, temperature=0.0) == run_alone(plain, tok, p, n, temperature=0.0)
        sampled = run_alone(spec, tok, prompts[0], n, temperature=1.0, seed=3)
        assert len(sampled) == n and all(0 <= t < tok.vocab_size for t in sampled)
        assert spec.metrics.value("tformer_pool_slots_in_use") == 0
        return spec.metrics
    finally:
        plain.close()
        spec.close()


@pytest.mark.parametrize("draft", ["same", "q4_0", "other"])
def test_a_draft_model_gives_plain_greedy_tokens(tmp_path, one_thread, draft):
    """A draft model drafting for the scheduler: the same model (every greedy draft must be accepted),
    its q4_0 copy, and another random model (most rejected: the rollback path); tokens equal the plain scheduler's either way, also when a second
    sequence takes the draft's cache and the first comes back later (a multi-turn chat's next turn);
    prompts sharing a prefix feed the draft only what follows it."""
    from tformer.quant.quantize import set_precision

    model, tok = tiny_checkpoint(tmp_path, context=128, positions="rope")
    with torch.no_grad():
        model.lm_head.weight.mul_(3)                                    # sharper: no greedy near-ties
    drafter = (copy.deepcopy(model) if draft == "same" else set_precision(copy.deepcopy(model), "q4_0")
               if draft == "q4_0" else tiny_checkpoint(tmp_path / "other", context=128, positions="rope", seed=1)[0])
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(0, tok.vocab_size, (10,), generator=g).tolist()
    prompts = [shared + torch.randint(0, tok.vocab_size, (6,), generator=g).tolist() for _ in range(3)]
    plain = Scheduler(copy.deepcopy(model), n_slots=2)
    spec = Scheduler(model, n_slots=2, speculative=4, draft_model=drafter)
    m = same_tokens_as_plain(spec, plain, tok, prompts + prompts[:1], 30)
    # (with the same model drafting, sampled drafts are all kept too: q = p, so u q < p always)
    drafted, accepted = m.value("tformer_speculative_drafted_tokens_total"), m.value("tformer_speculative_accepted_tokens_total")
    assert drafted > 0 and {"same": accepted == drafted, "q4_0": accepted > 0,
                            "other": accepted < drafted / 2}[draft], (drafted, accepted)


def test_draft_needs_speculative_and_another_precision(tmp_path):
    from tformer.errors import ConfigError

    tiny_checkpoint(tmp_path, context=64)
    with pytest.raises(ConfigError, match="--speculative"):
        build_server(str(tmp_path), draft="q8_0")
    with pytest.raises(ConfigError, match="other than --dtype"):
        build_server(str(tmp_path), speculative=4, draft="fp32")


@pytest.mark.parametrize("options", [{}, {"speculative": 4, "draft": "q8_0"}], ids=["plain", "draft"])
def test_load_with_a_shared_prefix_leaks_no_slot_or_block(tmp_path, one_thread, options):
    tiny_checkpoint(tmp_path, context=256)
    server = build_server(str(tmp_path), slots=8, max_queue=64, **options)
    running = Running(build_app(server))
    system = "You are a careful assistant. Answer in one short line. " * 2

    async def client(c, i):
        r = await c.post(running.url + "/v1/completions", json={"model": server.name,
            "prompt": system + f"Question {i}: what is {i} and {i}.", "max_tokens": 8 + i % 5, "temperature": 0})
        return r.status_code if r.status_code == 200 else r.text

    async def load():
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(*[client(c, i) for i in range(40)])
    try:
        codes = asyncio.run(load())
        metrics = httpx.get(running.url + "/metrics", timeout=10).text
    finally:
        running.stop()
    assert codes == [200] * 40
    m = server.metrics
    assert m.value("tformer_pool_slots_in_use") == 0
    assert m.value("tformer_prefix_cache_blocks_pinned") == 0
    assert m.value("tformer_prefix_cache_blocks") > 0
    assert m.value("tformer_prefix_cache_hit_blocks_total") >= 30 * (len(system) // 16 - 1)   # the system prompt reused
    assert "tformer_prefix_cache_hit_blocks_total" in metrics
    server.close()


def test_a_client_leaving_a_drafted_stream_frees_its_slot(tmp_path, one_thread):
    """A lone streaming request speculating with a draft model; the client reads two chunks and
    disconnects: its slot is free within a step and the next request's greedy text is the plain one."""
    from tformer.generation.text import generate_text

    model, tok = tiny_checkpoint(tmp_path, context=256, positions="rope")
    reference = copy.deepcopy(model)
    server = build_server(str(tmp_path), slots=2, max_queue=4, speculative=4, draft="q8_0")
    running = Running(build_app(server))
    body = {"model": server.name, "prompt": "abcabcabc", "max_tokens": 200, "temperature": 0, "stream": True}
    try:
        with httpx.stream("POST", running.url + "/v1/completions", json=body, timeout=60) as r:
            chunks = 0
            for line in r.iter_lines():
                chunks += line.startswith("data: {")
                if chunks == 2:
                    break                                               # leave mid-stream
        for _ in range(200):
            if server.metrics.value("tformer_pool_slots_in_use") == 0:
                break
            time.sleep(0.02)
        assert server.metrics.value("tformer_pool_slots_in_use") == 0
        r = httpx.post(running.url + "/v1/completions", timeout=60,
                       json={"model": server.name, "prompt": "hello there", "max_tokens": 24, "temperature": 0})
        assert r.status_code == 200
        assert r.json()["choices"][0]["text"] == generate_text(reference, tok, "hello there", 24, temperature=0)
        assert server.metrics.value("tformer_speculative_steps_total") > 0
    finally:
        running.stop()
        server.close()
