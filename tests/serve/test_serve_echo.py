"""Prompt log-probabilities: ``echo`` with ``logprobs`` on /v1/completions (what lm-eval's local-completions
sends: several prompts, ``max_tokens`` 0 or 1, ``temperature`` 0), in OpenAI's legacy shape. Reference: one
uncached forward of the model over each prompt alone, log_softmax in float64 (tolerance 1e-4, as
test_serve.py's logprobs); the agreement with lm-eval's own ``hf`` backend on the same weights is
benchmarks/serving/lm_eval_check.py's."""

from __future__ import annotations

import pytest
import torch

from serve_util import tiny_server


@pytest.fixture(scope="module")
def served(tmp_path_factory, one_thread):
    with tiny_server(tmp_path_factory.mktemp("ckpt"), slots=4, eos=[1]) as (model, tok, server, _, client):
        yield model, tok, server, client


def reference(model, ids: list[int]) -> torch.Tensor:
    """``(len(ids) - 1, vocab)`` log-probabilities of the tokens after each position, one full forward."""
    with torch.no_grad():
        logits, _ = model(torch.tensor([ids]))
    return torch.log_softmax(logits[0, :-1].double(), -1)


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_logprobs_of_several_prompts_equal_a_full_forward(served, max_tokens):
    model, tok, server, client = served
    prompts = ["def f(x): return x", "abc abc", "The quick brown fox jumps", "x"]
    out = client.completions.create(model=server.name, prompt=prompts, max_tokens=max_tokens, logprobs=2, echo=True,
                                    temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for text, choice in zip(prompts, out.choices):
        ids = tok.encode(text)
        lp = choice.logprobs
        assert choice.text.startswith(text) and len(lp.tokens) == len(ids) + max_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
        ref = reference(model, ids)
        for t in range(1, len(ids)):
            assert abs(lp.token_logprobs[t] - float(ref[t - 1, ids[t]])) < 1e-4
            best = ref[t - 1].topk(2)
            assert [tok.decode([i]) for i in best.indices.tolist()] == list(lp.top_logprobs[t])
        assert lp.text_offset == [sum(len(s) for s in lp.tokens[:i]) for i in range(len(lp.tokens))]
        if max_tokens:                                              # the greedy next token after the prompt
            with torch.no_grad():
                nxt = int(model(torch.tensor([ids]))[0][0, -1].argmax())
            assert lp.tokens[-1] == tok.decode([nxt]) and choice.finish_reason == "length"
    assert out.usage.completion_tokens == max_tokens * len(prompts)


def test_echo_scoring_leaves_no_slot_held_and_decoding_still_works(served):
    import httpx

    model, tok, server, client = served
    for _ in range(3):
        client.completions.create(model=server.name, prompt=["ab", "cd ef"], max_tokens=0, logprobs=0, echo=True)
    plain = client.completions.create(model=server.name, prompt="ab", max_tokens=5, temperature=0).choices[0].text
    again = client.completions.create(model=server.name, prompt="ab", max_tokens=5, temperature=0).choices[0].text
    assert plain == again
    url = str(client.base_url).rsplit("/v1", 1)[0]
    assert httpx.get(url + "/health").json()["free_slots"] == 4


def test_a_next_token_that_ends_the_sequence_is_still_reported(served):
    """lm-eval reads token_logprobs[ctxlen:-1], assuming one generated token after the prompt: when that token is
    an end-of-sequence id (here forced by logit_bias) it is still listed, with its logprob, and adds no text."""
    model, tok, server, client = served
    out = client.completions.create(model=server.name, prompt=["abc", "de f"], max_tokens=1, logprobs=1, echo=True,
                                    temperature=0, logit_bias={"1": 100})
    for text, choice in zip(["abc", "de f"], out.choices):
        assert choice.text == text and choice.finish_reason == "stop"
        assert len(choice.logprobs.tokens) == len(tok.encode(text)) + 1
