"""The prefix cache: prompts that share a prefix copy its cached KV blocks into their rows and
prefill only the rest, and then decode exactly as a cache-less pool does (greedy tokens equal; every
step's logits within 1e-4 of the cache-less run's, fp32: the suffix is computed in a different batch
shape, which rounds differently, and nothing else differs). The store stays within its budget,
evicts leaves only, and holds no pins after an admission."""

from __future__ import annotations

import pytest
import torch

from tformer import DecoderLM, TransformerConfig
from tformer.serve.metrics import Metrics
from tformer.serve.pool import KVPool
from tformer.serve.prefix_cache import PrefixCache

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(**options):
    torch.manual_seed(0)
    model = DecoderLM(TransformerConfig(vocab_size=61, context_length=128, n_layers=2, d_model=32, n_heads=4,
                                        **options)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30)                                   # sharp: no greedy near-ties
    return model


def run(pool: KVPool, slots: list[int], prompts: list[list[int]], steps: int):
    """Prefill ``prompts`` into ``slots`` and greedy-decode ``steps`` tokens: (tokens, logits) per prompt."""
    first = pool.prefill(slots, prompts)
    got, seen = [[int(t)] for t in first.argmax(-1)], [[row] for row in first]
    for _ in range(steps - 1):
        hi = max(slots) + 1
        tokens = torch.zeros(hi, dtype=torch.long)
        for s, out in zip(slots, got):
            tokens[s] = out[-1]
        logits = pool.decode(tokens, max(len(p) + len(o) for p, o in zip(prompts, got)))
        for i, (s, out) in enumerate(zip(slots, got)):
            out.append(int(logits[s].argmax()))
            seen[i].append(logits[s])
    return got, [torch.stack(r) for r in seen]


@pytest.mark.parametrize("options", [dict(positions="rope", n_kv_heads=2), dict(positions="learned"),
                                     dict(positions="alibi")], ids=["rope-gqa", "learned", "alibi"])
def test_cached_prefix_decodes_like_no_cache(options):
    model = tiny(**options)
    g = torch.Generator().manual_seed(1)
    system = torch.randint(0, 61, (40,), generator=g).tolist()
    prompts = [system + torch.randint(0, 61, (n,), generator=g).tolist() for n in (5, 9, 20, 3)]
    metrics = Metrics()
    pool = KVPool(model, 4, 128, prefix_cache_mb=1, metrics=metrics)
    ref = KVPool(model, 4, 128)
    run(pool, [0], prompts[:1], 2)                                       # warms the cache: 2 blocks of the system
    pool.release(0)
    assert len(pool.prefix) == 2
    got, seen = run(pool, [1, 2, 3, 0], prompts, 10)
    want, ref_seen = run(ref, [1, 2, 3, 0], prompts, 10)
    assert got == want
    for a, b in zip(seen, ref_seen):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    assert metrics.value("tformer_prefix_cache_hit_blocks_total") == 2 * 4     # each of the 4 found both blocks
    assert pool.prefix.pinned == 0


def test_multi_turn_history_reuses_the_finished_sequence():
    model = tiny(positions="rope")
    g = torch.Generator().manual_seed(2)
    first = torch.randint(0, 61, (20,), generator=g).tolist()
    pool = KVPool(model, 2, 128, prefix_cache_mb=1, metrics=Metrics())
    ref = KVPool(model, 2, 128)
    out, _ = run(pool, [0], [first], 30)
    held = first + out[0][:-1]                                          # the newest token is never written
    pool.release(0, held)
    assert len(pool.prefix) == len(held) // 16                          # the answer's blocks too
    second = held + [out[0][-1]] + torch.randint(0, 61, (7,), generator=g).tolist()
    hits = pool.prefix.metrics.value("tformer_prefix_cache_hit_blocks_total")
    got, seen = run(pool, [1], [second], 8)
    want, ref_seen = run(ref, [1], [second], 8)
    assert pool.prefix.metrics.value("tformer_prefix_cache_hit_blocks_total") - hits == len(held) // 16
    assert got == want
    torch.testing.assert_close(seen[0], ref_seen[0], atol=1e-4, rtol=0)


def test_a_prompt_that_is_all_cached_still_computes_its_last_token():
    model = tiny(positions="rope")
    prompt = list(range(32))                                            # exactly two blocks
    pool = KVPool(model, 2, 64, prefix_cache_mb=1)
    ref = KVPool(model, 2, 64)
    a = pool.prefill([0], [prompt])
    b = pool.prefill([1], [prompt])                                     # one block reused, 16 tokens computed
    torch.testing.assert_close(b, ref.prefill([0], [prompt]), atol=1e-4, rtol=0)
    torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_budget_evicts_least_recent_leaves_and_keeps_chains_reachable():
    block, data = 4, torch.zeros(1, 2, 1, 4, 2)                         # 64 bytes a block
    cache = PrefixCache(block, 3 * data.nbytes)
    read = lambda a, b: torch.zeros(1, 2, 1, b - a, 2)                  # noqa: E731
    assert cache.insert(list(range(8)), 2, read) == 2                   # chain A: a0 -> a1
    assert cache.insert([9] * 8, 2, read) == 2                          # chain B needs room: a1 (the leaf) goes
    assert len(cache) == 3 and cache.nbytes <= 3 * data.nbytes
    found = [cache.match(t, 2) for t in (list(range(8)), [9] * 8)]
    assert [len(f) for f in found] == [1, 2]
    for f in found:
        cache.unpin(f)
    assert cache.pinned == 0
    pinned = cache.match([9] * 8, 2)                                    # B's blocks in use cannot be evicted
    assert cache.insert([5] * 8, 2, read) == 1                          # a0 goes; b0, b1 stay pinned; then full
    assert len(cache.match([9] * 8, 2)) == 2
    cache.unpin(pinned)
    for b in cache.lru.values():                                        # every parent is still cached
        assert b.parent is None or b.parent.id in cache.lru


def test_no_prefix_cache_for_recurrent_layers():
    model = tiny(positions="none", mixer=["mamba", "attention"])
    assert KVPool(model, 2, 64, prefix_cache_mb=1).prefix is None


def test_smollm2_chats_sharing_a_system_prompt_decode_as_without_cache(smollm2):
    """The real model, fp32: greedy tokens equal and logits within 1e-3 (its logits are ~10x the tiny
    models', so the same relative rounding of a differently shaped prefill)."""
    from tformer.checkpoint import load_model
    from tformer.tokenizers import load_chat_template, load_tokenizer

    _, folder = smollm2
    model = load_model(folder).eval()
    tok, template = load_tokenizer(folder), load_chat_template(folder)
    system = {"role": "system", "content": "You are a concise assistant. You answer every question in one sentence."}
    prompts = [template.encode(tok, [system, {"role": "user", "content": q}])
               for q in ("What is 2 + 2?", "Name a colour.", "Where is Paris?")]
    torch.set_num_threads(2)
    pool, ref = KVPool(model, 3, 256, prefix_cache_mb=64), KVPool(model, 3, 256)
    run(pool, [0], prompts[:1], 1)
    got, seen = run(pool, [0, 1, 2], prompts, 6)
    want, ref_seen = run(ref, [0, 1, 2], prompts, 6)
    assert pool.prefix.metrics is None and len(pool.prefix) >= 2
    assert got == want
    for a, b in zip(seen, ref_seen):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=0)
