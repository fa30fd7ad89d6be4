"""Tool calls: the parsers on each format's fixed model outputs (Hermes / Qwen ``<tool_call>``, Llama 3.x
JSON with and without ``<|python_tag|>``, a generic JSON object), and the ``openai`` client driving an agent
loop against ``tformer serve --model smollm2``: a call (streamed and not), executed by the client, its result
sent back as a ``tool`` message, the model's next answer; with ``tool_choice: required`` 20 of 20 sampled calls
validate against the function's JSON schema (jsonschema, the independent check)."""

from __future__ import annotations

import json

import pytest

from serve_util import Running
from tformer.serve import tools
from tformer.serve.app import build_app
from tformer.serve.build import build_server

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"], "additionalProperties": False}}}
# a call made earlier and its result, as a client sends them back
EXCHANGE = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
            {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"}]


@pytest.mark.parametrize("text,content,calls", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
     None, [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ('Let me check.\n<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": '
     '{"x": 1}}</tool_call>', "Let me check.", [("a", {}), ("b", {"x": 1})]),
    ('{"name": "get_time", "parameters": {"zone": "UTC"}}', None, [("get_time", {"zone": "UTC"})]),      # Llama 3.x
    ('<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}', None, [("get_time", {"zone": "CET"})]),
    ('{"name": "f", "arguments": "{\\"k\\": [1, 2]}"}', None, [("f", {"k": [1, 2]})]),       # arguments as text
    ("The weather is fine.", "The weather is fine.", []),
    ('{"city": "Paris"}', '{"city": "Paris"}', []),                                           # JSON, not a call
    ('<tool_call>{"name": broken</tool_call>', '<tool_call>{"name": broken</tool_call>', []),
])
def test_parsers_on_fixed_outputs(text, content, calls):
    got_content, got = tools.parse(text)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in got)


def test_calls_and_results_are_rendered_back():
    messages = EXCHANGE
    out = tools.render_messages(messages, [WEATHER])
    assert out[0]["role"] == "system" and '"name": "get_weather"' in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": '
                                                      '{"city": "Paris", "unit": "celsius"}}\n</tool_call>'}
    assert out[3] == {"role": "tool", "content": '{"temp": 21}'}


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")       # SmolLM2's: no tools


@pytest.mark.parametrize("name", ["qwen3", "chatml"])
def test_a_template_that_takes_tools_renders_them_itself(name):
    """chat_ids hands the tools to a template that renders them (Qwen3's: its own <tools> block, the earlier
    call as its <tool_call>, the arguments an object) and writes them in Hermes text into the system message
    for one that does not (ChatML's)."""
    import asyncio
    from pathlib import Path
    from types import SimpleNamespace

    from tformer.serve.openai_api import chat_ids
    from tformer.tokenizers import ChatTemplate

    class Rendered(ChatTemplate):           # the rendered text instead of its ids: what the model would read
        def encode(self, tokenizer, messages, add_generation_prompt=True, parse_special=False, tools=None):
            return self.render(messages, add_generation_prompt, tools)
    source = (Path(__file__).parents[1] / "data" / "chat_templates" / "qwen3.jinja").read_text(encoding="utf-8") \
        if name == "qwen3" else CHATML
    server = SimpleNamespace(chat_template=Rendered(source), tokenizer=None, parse_special=False)
    messages = EXCHANGE
    [text] = asyncio.run(chat_ids(server, messages, [WEATHER]))
    assert server.chat_template.takes_tools == (name == "qwen3")
    assert ("You are a function calling AI model" in text) == (name == "chatml")          # the Hermes fallback
    assert text.count("The current weather in a city.") == 1
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in text
    if name == "qwen3":
        assert "<|im_start|>system\n# Tools" in text and "<tool_response>\n{\"temp\": 21}\n</tool_response>" in text


openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")


@pytest.fixture(scope="module")
def client(smollm2):
    pytest.importorskip("llguidance")
    server = build_server("smollm2", slots=8, max_model_len=1024)
    running = Running(build_app(server))
    yield openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    running.stop()


def weather(city: str, unit: str) -> str:
    return json.dumps({"city": city, "temperature": 21 if unit == "celsius" else 70, "unit": unit})


@pytest.mark.parametrize("stream", [False, True])
def test_an_agent_loop(client, stream):
    messages = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    kw = dict(model="smollm2", tools=[WEATHER, TIME], max_tokens=64, temperature=0)
    if stream:
        calls: dict[int, dict] = {}
        reason = None
        for chunk in client.chat.completions.create(messages=messages, tool_choice="required", stream=True, **kw):
            delta = chunk.choices[0].delta
            for c in delta.tool_calls or []:
                entry = calls.setdefault(c.index, {"id": c.id, "name": "", "arguments": ""})
                entry["name"] += c.function.name or ""
                entry["arguments"] += c.function.arguments or ""
            reason = chunk.choices[0].finish_reason or reason
        assert reason == "tool_calls" and len(calls) == 1
        call = calls[0]
    else:
        r = client.chat.completions.create(messages=messages, tool_choice="required", **kw)
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.tool_calls
        c = r.choices[0].message.tool_calls[0]
        call = {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
    args = json.loads(call["arguments"])
    schema = {"get_weather": WEATHER, "get_time": TIME}[call["name"]]["function"]["parameters"]
    jsonschema.validate(args, schema)
    result = weather(**args) if call["name"] == "get_weather" else json.dumps({"time": "12:00"})
    messages += [{"role": "assistant", "content": None, "tool_calls": [
                     {"id": call["id"], "type": "function", "function": {"name": call["name"],
                                                                         "arguments": call["arguments"]}}]},
                 {"role": "tool", "tool_call_id": call["id"], "content": result}]
    final = client.chat.completions.create(messages=messages, tool_choice="none", **kw)
    assert final.choices[0].finish_reason in ("stop", "length")
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


def test_required_calls_validate_20_of_20(client):
    from concurrent.futures import ThreadPoolExecutor

    questions = ["Weather in Paris?", "Is it cold in Oslo today?", "What time is it in Tokyo?",
                 "Tell me the temperature in Lima in fahrenheit.", "Weather for Cairo please."]

    def ask(i: int):
        r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": questions[i % 5]}],
                                           tools=[WEATHER, TIME], tool_choice="required", temperature=1.0, seed=i,
                                           max_tokens=96)
        return r.choices[0]
    with ThreadPoolExecutor(8) as pool:
        choices = list(pool.map(ask, range(20)))
    valid = 0
    for ch in choices:
        for c in ch.message.tool_calls or []:
            schema = {"get_weather": WEATHER, "get_time": TIME}[c.function.name]["function"]["parameters"]
            jsonschema.validate(json.loads(c.function.arguments), schema)
            valid += 1
    assert valid == 20 and all(ch.finish_reason == "tool_calls" for ch in choices), \
        [(ch.finish_reason, ch.message.content) for ch in choices if ch.finish_reason != "tool_calls"]
    named = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hello!"}],
                                           tools=[WEATHER, TIME], max_tokens=64, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named.choices[0].message.tool_calls[0].function.name == "get_time"
