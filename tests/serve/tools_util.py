"""Helpers for the tool-call tests: functions a client offers, the agent loop the ``openai`` client drives, and
``tool_choice: required`` calls checked against the functions' schemas with ``jsonschema`` (the independent check)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

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
QUESTIONS = ["Weather in Paris?", "Is it cold in Oslo today?", "What time is it in Tokyo?",
             "Tell me the temperature in Lima in fahrenheit.", "Weather for Cairo please."]


def schema_of(functions: list[dict], name: str) -> dict:
    return next(f["function"]["parameters"] for f in functions if f["function"]["name"] == name)


def execute(name: str, args: dict) -> str:
    """The client's side of a call: a made-up result for the function."""
    return json.dumps({"function": name, "arguments": args, "result": 21})


def one_call(client, stream: bool, **kw) -> tuple[dict, int]:
    """``({"id", "name", "arguments"}, argument fragments)``: the single call of one answer; streamed, the
    ``openai`` client's own stream helper accumulates the deltas and counts the arguments' fragments."""
    if stream:
        with client.chat.completions.stream(**kw) as events:
            fragments = sum(e.type == "tool_calls.function.arguments.delta" for e in events)
            r = events.get_final_completion()
    else:
        r, fragments = client.chat.completions.create(**kw), 0
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
    c = choice.message.tool_calls[0]
    assert c.type == "function" and c.id.startswith("call_")
    return {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}, fragments


def agent_loop(client, model: str, functions: list[dict], stream: bool, **kw) -> dict:
    """One turn of an agent: the model calls a function (``tool_choice: required``), the client runs it and
    sends the result back as a ``tool`` message, the model answers. Returns the call, its fragments and the
    final answer."""
    import jsonschema

    messages = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    call, fragments = one_call(client, stream, model=model, messages=messages, tools=functions,
                               tool_choice="required", **kw)
    args = json.loads(call["arguments"])
    jsonschema.validate(args, schema_of(functions, call["name"]))
    messages += [{"role": "assistant", "content": None, "tool_calls": [
                     {"id": call["id"], "type": "function", "function": {"name": call["name"],
                                                                         "arguments": call["arguments"]}}]},
                 {"role": "tool", "tool_call_id": call["id"], "content": execute(call["name"], args)}]
    final = client.chat.completions.create(model=model, messages=messages, tools=functions, tool_choice="none", **kw)
    return {"call": call, "fragments": fragments, "final": final.choices[0]}


def required_calls(client, model: str, functions: list[dict], n: int = 20, **kw) -> tuple[int, list]:
    """``(valid, choices)``: ``n`` sampled answers (seeds 0..n-1, 8 at a time) under ``tool_choice: required``,
    and how many of their calls validate against the called function's schema (jsonschema)."""
    import jsonschema

    def ask(i: int):
        return client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTIONS[i % 5]}],
                                              tools=functions, tool_choice="required", temperature=1.0, seed=i,
                                              **kw).choices[0]
    with ThreadPoolExecutor(8) as pool:
        choices = list(pool.map(ask, range(n)))
    valid = 0
    for ch in choices:
        for c in ch.message.tool_calls or []:
            jsonschema.validate(json.loads(c.function.arguments), schema_of(functions, c.function.name))
            valid += 1
    return valid, choices


def streamed_and_full(client, model: str, functions: list[dict], **kw) -> tuple[tuple, tuple]:
    """``(name, arguments)`` of the greedy required call streamed (the client's stream helper accumulating the
    deltas) and not."""
    kw = dict(model=model, messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=functions,
              tool_choice="required", temperature=0, **kw)
    full = client.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    with client.chat.completions.stream(**kw) as events:
        streamed = events.get_final_completion().choices[0].message.tool_calls[0]
    return ((streamed.function.name, json.loads(streamed.function.arguments)),
            (full.function.name, json.loads(full.function.arguments)))
