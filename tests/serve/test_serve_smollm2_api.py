"""SmolLM2-135M-Instruct served as people deploy it, driven by the official `openai` client (issue 27):
chat through the model's template that ends at its end-of-turn token, streams and counts usage; and
structured output (response_format) that is schema-valid on every one of 12 concurrent requests per schema
(benchmarks/serving/structured_output.py runs 50).

References: the prompt's token count is the chat template's own encoding (ChatTemplate.encode); the
JSON check is the `jsonschema` package (an independent implementation of JSON Schema), never the
grammar engine that constrained the output.
"""

from __future__ import annotations

import asyncio
import json

import pytest

import structured_util as structured
from serve_util import Running
from tformer.inference import end_of_turn_ids
from tformer.serve.build import build_server
from tformer.serve.app import build_app

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

N = 12                                     # requests per schema here; the script's run does 50 (results/serving)


@pytest.fixture(scope="module")
def served(smollm2):
    server = build_server("smollm2", slots=16, max_queue=64, max_model_len=512)
    running = Running(build_app(server, api_key="sk-test"))
    yield server, running
    running.stop()


def client(running, **kw):
    return openai.OpenAI(base_url=running.url + "/v1", api_key="sk-test", max_retries=0, timeout=300, **kw)


def test_the_end_of_turn_token_comes_from_the_template(served):
    server, _ = served
    assert end_of_turn_ids(server.chat_template, server.tokenizer) == [2]
    assert server.tokenizer.tok.id_to_token(2) == "<|im_end|>" and 2 in server.eos


def test_chat_ends_its_turn_streams_and_counts_usage(served):
    server, running = served
    c = client(running)
    assert [m.id for m in c.models.list().data][0] == "smollm2"
    messages = [{"role": "user", "content": "Say hello in one short sentence."}]
    r = c.chat.completions.create(model="smollm2", messages=messages, max_tokens=60, temperature=0)
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop", text           # the model ended its turn before 60 tokens
    assert "<|im_end|>" not in text and text.strip()
    assert r.usage.prompt_tokens == len(server.chat_template.encode(server.tokenizer, messages))
    assert r.usage.completion_tokens == len(server.tokenizer.encode(text, add_special_tokens=False))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    chunks = list(c.chat.completions.create(model="smollm2", messages=messages, max_tokens=60, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == text                                    # greedy: the stream says what the full answer said
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens


def test_json_object_mode_returns_an_object(served):
    _, running = served
    r = client(running).chat.completions.create(
        model="smollm2", max_tokens=48, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "What is the capital of France? Answer as JSON with the key city."}])
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_bad_tool_choices_and_response_formats_are_400s(served):
    _, running = served
    c = client(running)
    msgs = [{"role": "user", "content": "hi"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError, match="tool_choice names a function"):
        c.chat.completions.create(model="smollm2", messages=msgs, tools=[tool],
                                  tool_choice={"type": "function", "function": {"name": "g"}})
    with pytest.raises(openai.BadRequestError, match="needs tools"):
        c.chat.completions.create(model="smollm2", messages=msgs, tool_choice="required")
    with pytest.raises(openai.BadRequestError, match="json_schema"):
        c.chat.completions.create(model="smollm2", messages=msgs, response_format={"type": "json_schema"})
    with pytest.raises(openai.BadRequestError, match="cannot be used"):
        c.chat.completions.create(model="smollm2", messages=msgs, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}})


@pytest.mark.parametrize("name", sorted(structured.SCHEMAS))
def test_concurrent_requests_are_schema_valid(served, name):
    """N sampled requests at once (seeds 0..N-1, temperature 1: different answers): every one is JSON
    valid against the schema (jsonschema) and ended by the model (finish_reason "stop"), and the
    server holds no slot afterwards. benchmarks/serving/structured_output.py runs 50 per schema."""
    server, running = served
    schema = structured.SCHEMAS[name][0]
    answers = asyncio.run(structured.ask(running.url, "sk-test", name, N))
    texts = [a.choices[0].message.content for a in answers]
    for a, text in zip(answers, texts):
        assert a.choices[0].finish_reason == "stop", text
        jsonschema.validate(json.loads(text), schema)
        assert structured.valid(a, schema)
    assert len(set(texts)) > 1                                  # sampling really varied the answers
    assert server.scheduler.metrics.value("tformer_pool_slots_in_use") == 0


def test_the_mask_allows_only_prefixes_of_the_language(smollm2):
    """The VERDICT schema's language is four strings (compact separators, declared order): written out
    by hand here, it is the reference. Along each string's tokens, every token the mask allows must
    extend the text to a prefix of one of the four (soundness; llguidance may allow fewer spellings);
    the string's own next token is allowed; at the end only the end-of-turn token is. Raw control
    characters in a string (invalid JSON) are never allowed (why llguidance is the engine)."""
    from tformer.serve.grammar import GrammarEngine
    from tformer.tokenizers import load_tokenizer

    tok = load_tokenizer(smollm2[1])
    engine = GrammarEngine(tok, 49152, [2])
    language = [f'{{"answer": "{a}", "confident": {c}}}' for a in ("yes", "no") for c in ("true", "false")]
    pieces = [tok.decode([t]) for t in range(49152)]
    for text in language:
        c, ids = engine.json(structured.VERDICT), tok.encode(text, add_special_tokens=False)
        for i, t in enumerate(ids + [None]):
            allowed = c.allowed().nonzero().flatten().tolist()
            if t is None:
                assert allowed == [2]
                break
            done = tok.decode(ids[:i])
            assert t in allowed and allowed
            bad = [a for a in allowed if not pieces[a] or not any(w.startswith(done + pieces[a]) for w in language)]
            assert bad == [], (done, [pieces[a] for a in bad][:5])
            c.advance(t)
    c = engine.json(structured.PERSON)
    for t in tok.encode('{"name": "B', add_special_tokens=False):
        c.advance(t)
    allowed = c.allowed()
    assert not any(allowed[t] for t in range(49152) if any(ord(ch) < 0x20 for ch in pieces[t]))
