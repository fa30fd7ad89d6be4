"""``/v1/responses`` through the ``openai`` client's ``responses.create`` (plain and streamed), and the
``<think>`` split into ``reasoning_content``. References: the same request's answer through
/v1/chat/completions (greedy, the same rendering), whose text equals generate_text's (test_serve.py); the
splitter on fixed Qwen3-style outputs, whole and fed one character at a time; and for a template that opens
``<think>`` (SmolLM2 with a test template), the raw greedy text of /v1/completions on the same prompt ids."""

from __future__ import annotations

import openai
import pytest

from serve_util import Running, tiny_server
from tformer.serve import reasoning
from tformer.serve.app import build_app
from tformer.serve.build import build_server


@pytest.mark.parametrize("text,thinking,expected", [
    ("<think>\nTwo and two.\n</think>\n\nIt is 4.", False, ("\nTwo and two.\n", "It is 4.")),
    ("  <think>a</think>b", False, ("a", "b")),
    ("It is 4.", False, (None, "It is 4.")),
    ("Say <think> later</think> x", False, (None, "Say <think> later</think> x")),
    ("still thinking", True, ("still thinking", "")),
    ("reasons</think>answer", True, ("reasons", "answer")),
    ("<thi", False, (None, "<thi")),
])
def test_split_whole_and_streamed(text, thinking, expected):
    assert reasoning.split(text, thinking) == expected
    s = reasoning.Splitter(thinking)
    parts = [p for ch in text for p in s.feed(ch)] + s.flush()
    got = ("".join(t for f, t in parts if f == "reasoning_content") if s.thought else None,
           "".join(t for f, t in parts if f == "content"))
    assert got == expected


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, one_thread):
    with tiny_server(tmp_path_factory.mktemp("ckpt"), slots=4) as (_, _, server, _, client):
        yield server, client


def test_responses_plain_and_streamed_equal_chat(tiny):
    server, client = tiny
    chat = client.chat.completions.create(model=server.name, max_tokens=10, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]).choices[0].message.content
    r = client.responses.create(model=server.name, instructions="Be brief.", input="Say hi", max_output_tokens=10,
                                temperature=0)
    assert r.output_text == chat and r.status == "incomplete" and r.usage.output_tokens == 10
    parts = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Say hi"}]}]
    events = list(client.responses.create(model=server.name, instructions="Be brief.", input=parts,
                                          max_output_tokens=10, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == chat
    assert events[-1].response.output_text == chat
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=server.name, input="x", tools=[{"type": "function", "name": "f"}])


THINKING = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")


def test_a_template_that_opens_think_splits_reasoning(smollm2):
    from tformer.tokenizers import ChatTemplate

    server = build_server("smollm2", slots=2, max_model_len=512)
    server.chat_template = ChatTemplate(THINKING, eos_token="<|im_end|>")
    running = Running(build_app(server))
    try:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "What is 2 + 2? Think first."}]
        ids = server.chat_template.encode(server.tokenizer, messages)
        raw = client.completions.create(model="smollm2", prompt=ids, max_tokens=60, temperature=0).choices[0].text
        expected = reasoning.split(raw, thinking=True)
        msg = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=60,
                                             temperature=0).choices[0].message
        assert (msg.model_extra["reasoning_content"], msg.content) == expected and expected[0]
        chunks = list(client.chat.completions.create(model="smollm2", messages=messages, max_tokens=60,
                                                     temperature=0, stream=True))
        streamed = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                           for c in chunks if c.choices)
        assert streamed == expected[0]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected[1]
        r = client.responses.create(model="smollm2", input=messages[0]["content"], max_output_tokens=60, temperature=0)
        assert r.output[0].type == "reasoning" and r.output_text == expected[1]
    finally:
        running.stop()
