"""The samplers through `tformer serve`: min_p, repetition / presence / frequency penalties and logit_bias,
per request, in one batch of concurrent requests. Reference: tformer.generation.text.generate_text (the
single-request path, whose penalties and min-p are checked against transformers' and llama.cpp's in
tests/generation/test_penalties.py) with the same options and seed; and a GGUF's general.sampling.*
recommendations used where a request leaves a field out."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from serve_util import tiny_server
from tformer.generation.text import generate_text

CASES = [dict(temperature=0.0, repetition_penalty=1.8),
         dict(temperature=0.0, frequency_penalty=1.5, presence_penalty=0.5),
         dict(temperature=0.0, logit_bias={"3": -100.0, "7": 4.0}),
         dict(temperature=0.9, min_p=0.1, seed=5),
         dict(temperature=1.2, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.3, seed=11),
         dict(temperature=0.0)]


@pytest.fixture(scope="module")
def served(tmp_path_factory, one_thread):
    with tiny_server(tmp_path_factory.mktemp("ckpt"), slots=8) as (model, tok, server, _, client):
        yield model, tok, server, client


def options(case: dict) -> dict:
    """The request's options as generate_text's keywords."""
    out = dict(case)
    if "logit_bias" in out:
        out["logit_bias"] = {int(k): v for k, v in out["logit_bias"].items()}
    return out


def test_each_sampler_in_one_batch_equals_generate(served):
    model, tok, server, client = served
    prompt = "abab abab abab"

    def ask(case):
        extra = {k: case[k] for k in ("repetition_penalty", "min_p", "top_k") if k in case}
        std = {k: v for k, v in case.items() if k not in extra}
        return client.completions.create(model=server.name, prompt=prompt, max_tokens=24, extra_body=extra,
                                         **std).choices[0].text
    with ThreadPoolExecutor(len(CASES)) as pool:                 # concurrent: decoded in one batch
        texts = list(pool.map(ask, CASES))
    plain = generate_text(model, tok, prompt, 24, temperature=0.0)
    for case, text in zip(CASES, texts):
        assert text == generate_text(model, tok, prompt, 24, **options(case)), case
        if case.get("temperature") == 0.0 and len(case) > 1:
            assert text != plain, case                           # each option changed something here


def test_a_bias_bans_a_token(served):
    _, tok, server, client = served
    free = client.completions.create(model=server.name, prompt="abc", max_tokens=1, temperature=0).choices[0].text
    banned = client.completions.create(model=server.name, prompt="abc", max_tokens=1, temperature=0,
                                       logit_bias={str(tok.encode(free)[0]): -100}).choices[0].text
    assert banned != free


def test_bad_penalties_are_400(served):
    _, _, server, client = served
    for extra in ({"repetition_penalty": 0}, {"min_p": 1.5}, {"presence_penalty": 3.0}, {"logit_bias": {"a": 1}}):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=server.name, prompt="a", max_tokens=2, extra_body=extra)


def test_the_files_recommendation_fills_what_a_request_leaves_out(served):
    """Server.defaults (a GGUF's general.sampling.*) apply to fields the request does not send; a field it
    sends wins."""
    _, _, server, _ = served
    from tformer.serve.schemas import CompletionRequest

    server.defaults = {"temperature": 0.0, "min_p": 0.2, "repetition_penalty": 1.1}
    try:
        chosen = server.sampling(CompletionRequest(model=server.name, prompt="a", temperature=0.7))
    finally:
        server.defaults = {}
    assert chosen == {"temperature": 0.7, "top_p": 1.0, "top_k": None, "min_p": 0.2, "repetition_penalty": 1.1}
