"""Speculative decoding. Greedy: the tokens of plain greedy generation, exactly (tiny models with sharp
logits, so the rounding of a k+1-token forward against a one-token one cannot flip an argmax; and
SmolLM2 on 5 chat prompts). Sampling: every emitted token is distributed as the target distribution.
The accept / reject rule is checked against the closed form on a toy distribution (40 000 fixed-seed
draws: total variation <= 0.015, about 4x its sampling noise, and the acceptance rate within 0.01 of
sum min(p, q)); the whole generation on a tiny model against the exact marginal of its second token
(3 000 draws over 8 tokens: total variation <= 0.06, about 3x the noise)."""

from __future__ import annotations

import copy

import pytest
import torch

from tformer import DecoderLM, TransformerConfig, generate
from tformer.generation.speculative import accept_greedy, accept_sampled, generate_speculative, lookup_draft
from tformer.quant.quantize import set_precision

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(vocab=11, sharp=30.0, **options):
    torch.manual_seed(0)
    model = DecoderLM(TransformerConfig(vocab_size=vocab, context_length=128, n_layers=2, d_model=32, n_heads=4,
                                        positions="rope", **options)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharp)
    return model


def test_lookup_draft_copies_what_followed_the_last_ngram():
    assert lookup_draft([1, 2, 3, 4, 9, 1, 2], 2) == [3, 4]             # the 2-gram (1, 2) seen before
    assert lookup_draft([1, 2, 3, 9, 3, 7, 2, 3], 3) == [9, 3, 7]       # longest match (2, 3) wins over (3,)
    assert lookup_draft([5, 5, 5], 3) == [5, 5, 5]                      # a loop continues with its period
    assert lookup_draft([1, 2, 1, 2, 1], 4) == [2, 1, 2, 1]
    assert lookup_draft([1, 2, 3], 2) == []


@pytest.mark.parametrize("options", [dict(), dict(n_kv_heads=2, sliding_window=6)], ids=["mha", "gqa-window"])
def test_greedy_speculation_gives_plain_greedy_tokens(options):
    model = tiny(**options)
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        prompt = torch.randint(0, 11, (1, 9), generator=g)
        want = generate(model, prompt, 40, temperature=0)[0, 9:].tolist()
        for k in (1, 4):
            got, stats = generate_speculative(model, prompt, 40, k=k)
            assert got == want
            assert stats.steps > 0 and stats.accepted > 0


def test_a_four_bit_draft_model_keeps_greedy_exact():
    model = tiny(vocab=64)
    draft = set_precision(copy.deepcopy(model), "q4_0")
    prompt = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(3))
    want = generate(model, prompt, 30, temperature=0)[0, 12:].tolist()
    got, stats = generate_speculative(model, prompt, 30, k=3, draft_model=draft)
    assert got == want
    assert stats.acceptance > 0.5                                       # the 4-bit copy mostly agrees


def test_greedy_rule_stops_at_the_first_mismatch():
    logits = torch.full((4, 5), -1.0)
    logits[0, 2] = logits[1, 4] = logits[2, 1] = logits[3, 0] = 1.0      # argmax: 2, 4, 1, 0
    assert accept_greedy(logits, [2, 4, 1]) == [2, 4, 1, 0]              # all kept, plus the bonus
    assert accept_greedy(logits, [2, 3, 1]) == [2, 4]                    # second draft wrong: the model's token


@pytest.mark.parametrize("draft_q", [None, [0.1, 0.5, 0.2, 0.1, 0.1]], ids=["point-mass", "draft-distribution"])
def test_sampled_rule_emits_the_target_distribution(draft_q):
    p = torch.tensor([[0.4, 0.1, 0.3, 0.15, 0.05], [0.2, 0.2, 0.2, 0.2, 0.2]])   # p_0 (checked), p_1 (bonus)
    g = torch.Generator().manual_seed(0)
    q = None if draft_q is None else torch.tensor([draft_q])
    n, counts, kept = 40_000, torch.zeros(5), 0
    for _ in range(n):
        d = 2 if q is None else int(torch.multinomial(q[0], 1, generator=g))
        out = accept_sampled(p, [d], g, q)
        counts[out[0]] += 1
        kept += len(out) == 2
    tv = 0.5 * (counts / n - p[0]).abs().sum()
    assert tv <= 0.015, tv
    closed = p[0, 2] if q is None else torch.minimum(p[0], q[0]).sum()     # P(accept) = sum_x min(p, q)
    assert abs(kept / n - float(closed)) <= 0.01


def test_sampled_generation_matches_the_models_distribution():
    model = tiny(vocab=8, sharp=1.0)                                    # broad distributions
    prompt = torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2]])                   # lookup always drafts (3, 1, ...)
    with torch.no_grad():
        p1 = torch.softmax(model(prompt)[0][0, -1], -1)                 # (8,) first new token
        both = torch.cat([prompt.repeat(8, 1), torch.arange(8)[:, None]], 1)
        p2 = (p1[:, None] * torch.softmax(model(both)[0][:, -1], -1)).sum(0)   # (8,) second token's marginal
    g = torch.Generator().manual_seed(0)
    n, counts = 3000, torch.zeros(8)
    for _ in range(n):
        out, stats = generate_speculative(model, prompt, 2, k=2, temperature=1.0, generator=g)
        counts[out[1]] += 1
    assert stats.drafted > 0
    tv = 0.5 * (counts / n - p2).abs().sum()
    assert tv <= 0.06, tv


def test_smollm2_greedy_speculation_is_exact(smollm2):
    from tformer.checkpoint import load_model
    from tformer.tokenizers import load_chat_template, load_tokenizer

    _, folder = smollm2
    model = set_precision(load_model(folder).eval(), "fp32")
    tok, template = load_tokenizer(folder), load_chat_template(folder)
    text = "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun all day."
    asks = [f"Repeat this sentence exactly: {text}", f"Rewrite in the past tense: {text}",
            "Fix the bug: def add(a, b): return a - b", f"Summarise: {text}", "List three colours."]
    torch.set_num_threads(2)
    for ask in asks:
        ids = torch.tensor([template.encode(tok, [{"role": "user", "content": ask}])])
        want = generate(model, ids, 16, temperature=0)[0, ids.shape[1]:].tolist()
        got, _ = generate_speculative(model, ids, 16, k=4)
        assert got == want, ask


def test_extend_gives_every_positions_logits_and_truncate_rolls_back():
    from tformer.generation.step import extend, prefill

    model = tiny(sharp=1.0)
    ids = torch.randint(0, 11, (1, 14), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = model(ids)[0][0]                                         # (14, V) reference: one uncached forward
        state = model.new_state(1, 32)
        prefill(model, ids[:, :8], state)
        got = extend(model, ids[:, 8:12], state)[0]                     # (4, V) after tokens 8..11
        torch.testing.assert_close(got, full[8:12], atol=1e-5, rtol=0)
        state.truncate(10)                                              # forget tokens 10, 11 ("rejected")
        assert state.length == 10 and not state.valid[0, 10:].any()
        again = extend(model, ids[:, 10:14], state)[0]
        torch.testing.assert_close(again, full[10:14], atol=1e-5, rtol=0)


def test_model_draft_feeds_only_what_follows_the_prefix_it_holds(monkeypatch):
    """ModelDraft's cache keeps the longest prefix it shares with the next history: after a rejected
    draft it feeds the accepted tokens only, and another sequence with the same opening (a chat's
    system prompt) feeds what follows it. Its drafts equal those of a fresh draft on the same history."""
    import tformer.generation.speculative as speculative

    model = tiny(vocab=64)
    fed = []
    real = speculative.extend
    monkeypatch.setattr(speculative, "extend", lambda m, ids, s: fed.append(ids.shape[1]) or real(m, ids, s))
    draft = speculative.ModelDraft(model, 64)
    shared = [3, 17, 5, 42, 8, 11, 2, 9]
    with torch.inference_mode():
        first, _ = draft.propose(shared + [1, 30], 3, 0.0)
        assert fed == [10, 1, 1]
        fed.clear()
        history = shared + [1, 30] + first[:1] + [7]             # one draft kept, then the target's own token
        again, _ = draft.propose(history, 3, 0.0)
        assert fed == [1, 1, 1]                                  # only the target's own token: d1 is held
        assert again == speculative.ModelDraft(model, 64).propose(history, 3, 0.0)[0]
        fed.clear()
        other = shared + [60, 4, 4]
        drafted, _ = draft.propose(other, 2, 0.0)
        assert fed == [3, 1]                                     # the shared 8 tokens reused
        assert drafted == speculative.ModelDraft(model, 64).propose(other, 2, 0.0)[0]
