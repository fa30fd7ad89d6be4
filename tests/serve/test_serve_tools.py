"""Tool calls: the parsers on each format's fixed model outputs (Hermes / Qwen ``<tool_call>``, Llama 3.x
JSON with and without ``<|python_tag|>``, a generic JSON object; malformed ones too), whole and fed in pieces
as a stream reads them, and the ``openai`` client driving an agent loop against ``tformer serve --model smollm2``:
a call (streamed, accumulated by the client's own stream helper, and not), executed by the client, its result
sent back as a ``tool`` message, the model's next answer; with ``tool_choice: required`` 20 of 20 sampled calls
validate against the function's JSON schema (jsonschema, the independent check)."""

from __future__ import annotations

import json

import pytest

from serve_util import Running
from tformer.serve import tools
from tformer.serve.app import build_app
from tformer.serve.build import build_server
from tools_util import EXCHANGE, TIME, WEATHER, agent_loop, required_calls, streamed_and_full


# Fixed model outputs in each family's format: (text, content, [(name, arguments)]).
HERMES = [        # Hermes / Qwen2.5 / Qwen3: <tool_call>{json}</tool_call>, anywhere, one or more
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
     None, [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ('Let me check.\n<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": '
     '{"x": 1}}</tool_call>', "Let me check.", [("a", {}), ("b", {"x": 1})]),
    # braces and quotes inside strings
    ('<tool_call>{"name": "f", "arguments": {"q": "say \\"hi\\" }{", "n": [{"a": "}"}]}}</tool_call>',
     None, [("f", {"q": 'say "hi" }{', "n": [{"a": "}"}]})]),
    ('<tool_call>{"arguments": {"zone": "UTC"}, "name": "get_time"}</tool_call>', None,        # name second
     [("get_time", {"zone": "UTC"})]),
    ('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": </tool_call>',  # one call broken
     '<tool_call>{"name": </tool_call>', [("a", {})]),
    # malformed: no calls, the text given back as it is
    ('<tool_call>{"name": broken</tool_call>', '<tool_call>{"name": broken</tool_call>', []),
    ('<tool_call>{"city": "Paris"}</tool_call>', '<tool_call>{"city": "Paris"}</tool_call>', []),   # no name
    ('<tool_call>{"name": "get_time", "argu', '<tool_call>{"name": "get_time", "argu', []),       # cut off
    ("a < b and <tool_cal", "a < b and <tool_cal", []),
]
LLAMA3 = [        # Llama 3.x: the whole answer one JSON object with "parameters", after <|python_tag|> or not
    ('{"name": "get_time", "parameters": {"zone": "UTC"}}', None, [("get_time", {"zone": "UTC"})]),
    ('<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}', None, [("get_time", {"zone": "CET"})]),
    ('\n {"name" : "get_time" ,\n "parameters" :{ "zone":"CET" } }\n', None, [("get_time", {"zone": "CET"})]),
    # malformed
    ('<|python_tag|>print("hello")', '<|python_tag|>print("hello")', []),
    ('{"name": 5, "parameters": {}}', '{"name": 5, "parameters": {}}', []),
    ('Sure: {"name": "get_time", "parameters": {"zone": "UTC"}}',
     'Sure: {"name": "get_time", "parameters": {"zone": "UTC"}}', []),     # a call is the whole answer, not a quote
]
GENERIC = [       # any JSON object with "name" and "arguments" (an object or its JSON text)
    ('{"name": "f", "arguments": "{\\"k\\": [1, 2]}"}', None, [("f", {"k": [1, 2]})]),
    ('{"arguments": {"x": 1}, "name": "f"}', None, [("f", {"x": 1})]),
    # malformed
    ("The weather is fine.", "The weather is fine.", []),
    ('{"city": "Paris"}', '{"city": "Paris"}', []),                                           # JSON, not a call
    ('{"name": "f", "arguments": "{not json"}', '{"name": "f", "arguments": "{not json"}', []),
    ('{"name": "f", "argu', '{"name": "f", "argu', []),
]
FIXED = HERMES + LLAMA3 + GENERIC


def calls_of(got: list[dict]) -> list[tuple]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got]


@pytest.mark.parametrize("text,content,calls", FIXED)
def test_parsers_on_fixed_outputs(text, content, calls):
    got_content, got = tools.parse(text)
    assert got_content == content
    assert calls_of(got) == calls
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in got)


@pytest.mark.parametrize("text,content,calls", FIXED)
def test_a_stream_reads_what_the_whole_answer_holds(text, content, calls):
    """The text fed in pieces (one character at a time, and cut in two at every place) gives the same content
    and calls as the whole, and a call's name comes in the delta before any of its arguments."""
    from tformer.serve.tool_calls import CallReader

    cuts = [list(text)] + [[text[:i], text[i:]] for i in range(1, len(text))]
    for pieces in cuts:
        reader = CallReader()
        out = [p for piece in pieces for p in reader.feed(piece)] + reader.flush()
        named: set[int] = set()
        for p in out:
            if p[0] == "call":
                named.add(p[1])
            elif p[0] == "arguments":
                assert p[1] in named
        got = [(c["name"], json.loads(c["arguments"])) for c in reader.calls]
        assert got == calls
        said = "".join(p[1] for p in out if p[0] == "content")
        assert (said.strip() or None) == content if calls else said == text


def test_a_call_cut_off_keeps_its_arguments_as_written():
    """A call cut by max_tokens (finish_reason length) is still a call, its arguments the unfinished JSON the
    model wrote, as OpenAI's; in a stream its name and first fragments have gone out already."""
    content, got = tools.parse('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par')
    assert content is None and got[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Par'}


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


@pytest.mark.parametrize("stream", [False, True])
def test_an_agent_loop(client, stream):
    got = agent_loop(client, "smollm2", [WEATHER, TIME], stream, max_tokens=64, temperature=0)
    assert got["final"].finish_reason in ("stop", "length")
    assert got["final"].message.content and not got["final"].message.tool_calls
    if stream:                                   # the arguments came as the tokens did, not in one piece
        assert got["fragments"] > 1


def test_a_streamed_call_equals_the_full_one(client):
    streamed, full = streamed_and_full(client, "smollm2", [WEATHER, TIME], max_tokens=64)
    assert streamed == full


def test_required_calls_validate_20_of_20(client):
    valid, choices = required_calls(client, "smollm2", [WEATHER, TIME], max_tokens=96)
    assert valid == 20 and all(ch.finish_reason == "tool_calls" for ch in choices), \
        [(ch.finish_reason, ch.message.content) for ch in choices if ch.finish_reason != "tool_calls"]
    named = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hello!"}],
                                           tools=[WEATHER, TIME], max_tokens=64, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named.choices[0].message.tool_calls[0].function.name == "get_time"


def test_thinking_then_calls_stream_as_openai_deltas():
    """A Qwen3-style answer (thinking, a sentence, two calls) streamed token by token through the chat format's
    readers: the ``openai`` library's own stream accumulator (``ChatCompletionStreamState``) rebuilds the
    message the full response gives, the thinking kept out of both calls."""
    from types import SimpleNamespace

    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    from tformer.serve import schemas as S
    from tformer.serve.openai_api import ChatFormat
    from tformer.serve.scheduler import Token

    answer = ('<think>\nThe user wants weather and time.\n</think>\n\nChecking both.\n<tool_call>\n{"name": '
              '"get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n'
              '{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
    fmt = ChatFormat(SimpleNamespace(), logprobs=False, tools=True)
    chunks = [fmt.first(0)] + [fmt.delta(0, Token(1, answer[i:i + 3]), 0) for i in range(0, len(answer), 3)]
    chunks += fmt.tail(0) + [fmt.last(0, "stop")]
    state = ChatCompletionStreamState()
    for c in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(S.chat_object("chatcmpl-1", "m", [c], None, chunk=True)))
    streamed = state.get_final_completion().choices[0]
    full, reason = fmt.answer(answer, "stop")
    assert streamed.finish_reason == reason == "tool_calls"
    assert streamed.message.content == full["content"] == "Checking both."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in streamed.message.tool_calls] == \
        calls_of(full["tool_calls"]) == [("get_weather", {"city": "Oslo", "unit": "celsius"}),
                                         ("get_time", {"zone": "CET"})]
    thought = "".join((c["delta"].get("reasoning_content") or "") for c in chunks)
    assert thought == full["reasoning_content"] == "\nThe user wants weather and time.\n"
    assert sum(bool(c["delta"].get("tool_calls")) for c in chunks) > 4          # the arguments came in pieces
