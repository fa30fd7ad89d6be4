"""Tool calls on a random-weight Qwen3 (its published configuration cut to 2 layers, tests/interop/families.py)
whose chat template renders ``tools`` itself in Qwen3's layout (``families.QWEN3_TOOLS_CHAT``): the prompt the
server builds equals transformers' ``apply_chat_template`` of the same messages and tools (ids), and the
``openai`` client drives the agent loop (a call streamed and not, executed, its result sent back as a ``tool``
message, the next answer); with ``tool_choice: required`` 20 of 20 sampled calls validate (jsonschema).

Random weights have no reason to end a JSON string: the functions bound their strings (``maxLength``) and
numbers as a client's schema may, and the grammar holds every call to them."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from serve_util import Running
from tools_util import agent_loop, required_calls, streamed_and_full

pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "interop"))
import families as F  # noqa: E402

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
BOOK = {"type": "function", "function": {
    "name": "book_table", "description": "Book a table at a restaurant.",
    "parameters": {"type": "object", "properties": {"restaurant": {"type": "string", "maxLength": 24},
                                                    "people": {"type": "integer", "minimum": 1, "maximum": 12},
                                                    "outside": {"type": "boolean"}},
                   "required": ["restaurant", "people", "outside"], "additionalProperties": False}}}
FUNCTIONS = [WEATHER, BOOK]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """The random Qwen3 folder (transformers' save_pretrained), its template in tokenizer_config.json."""
    folder = F.hf_folder("qwen3-0.6b", tmp_path_factory.mktemp("qwen3-tools"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": F.QWEN3_TOOLS_CHAT,
                                                              "eos_token": "<|im_end|>"}), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def served(qwen3):
    from tformer.serve.app import build_app
    from tformer.serve.build import build_server

    server = build_server(str(qwen3), slots=8, max_model_len=2048)
    running = Running(build_app(server))
    yield server, openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    running.stop()


def test_the_prompt_is_the_templates_own(qwen3, served):
    """The server shows the tools through the model's template (not the Hermes fallback), earlier calls'
    arguments as objects: the same ids as transformers renders and encodes."""
    from transformers import PreTrainedTokenizerFast

    from tformer.serve.openai_api import chat_ids

    server, _ = served
    assert server.chat_template.takes_tools
    sent = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
            {"role": "tool", "tool_call_id": "call_2", "content": '{"wind": 3}'}]
    [ids] = asyncio.run(chat_ids(server, sent, FUNCTIONS))
    hf = PreTrainedTokenizerFast(tokenizer_file=str(qwen3 / "tokenizer.json"), chat_template=F.QWEN3_TOOLS_CHAT)
    reference = [dict(m) for m in sent]
    reference[2] = {**sent[2], "content": "", "tool_calls": [{**sent[2]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]}
    want = hf.apply_chat_template(reference, tools=FUNCTIONS, add_generation_prompt=True, tokenize=True,
                                  return_dict=False)
    assert ids == list(want)
    text = hf.decode(ids)
    assert "<tools>\n" + json.dumps(WEATHER) in text and "</tool_response>\n<tool_response>" in text


@pytest.mark.parametrize("stream", [False, True])
def test_an_agent_loop(served, stream):
    server, client = served
    got = agent_loop(client, server.name, FUNCTIONS, stream, max_tokens=128, temperature=0)
    assert got["final"].finish_reason in ("stop", "length") and got["final"].message.content
    if stream:
        assert got["fragments"] > 1              # the arguments streamed as they were written


def test_a_streamed_call_equals_the_full_one(served):
    server, client = served
    streamed, full = streamed_and_full(client, server.name, FUNCTIONS, max_tokens=128)
    assert streamed == full


def test_required_calls_validate_20_of_20(served):
    server, client = served
    valid, choices = required_calls(client, server.name, FUNCTIONS, max_tokens=160)
    assert valid == 20 and all(ch.finish_reason == "tool_calls" for ch in choices), \
        [(ch.finish_reason, ch.message.content) for ch in choices if ch.finish_reason != "tool_calls"]
    named = client.chat.completions.create(model=server.name, messages=[{"role": "user", "content": "Hello!"}],
                                           tools=FUNCTIONS, max_tokens=160, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "book_table"}})
    assert named.choices[0].message.tool_calls[0].function.name == "book_table"
