"""Tool calls in chat: the functions shown to the model, the shape its answer is held to, and the answer parsed.

**Shown.** A chat template that renders ``tools`` itself (Qwen3's, Llama 3.x's:
:attr:`tformer.tokenizers.ChatTemplate.takes_tools`) gets them as transformers passes them, and the
messages with their calls and results as they are. For one that does not (SmolLM2's ChatML, a checkpoint
with no template), the functions go into the system message as text, in the Hermes format most small
models saw in training: their JSON signatures inside ``<tools></tools>`` and the instruction to answer with
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; an assistant message that made calls is
rendered back in that form, and a ``role: tool`` message as the tool's turn with its result, so the model
reads the whole exchange (:func:`for_template` chooses).

**Held to.** ``tool_choice: "required"`` or a named function constrains the answer with the grammar engine
structured output uses (:mod:`tformer.serve.grammar`): a JSON value ``{"name": <one of the functions>,
"arguments": <valid for its parameters schema>}``, so even a small model's call validates.
``"auto"`` lets the model choose; ``"none"`` shows no tools.

**Parsed** (:func:`parse`), whichever format the model wrote: Hermes / Qwen ``<tool_call>{json}</tool_call>``
(one or more), Llama 3.x's bare JSON ``{"name": ..., "parameters": {...}}`` (after ``<|python_tag|>`` or
not), and a generic JSON object with ``name`` and ``arguments``. Text outside the calls stays the content.
A stream reads the answer the same way as it comes (:class:`tformer.serve.tool_calls.CallReader`).
"""

from __future__ import annotations

import json

from tformer.serve.tool_calls import CallReader

SYSTEM = ("You are a function calling AI model. You may call one or more functions to assist with the user query. "
          "Here are the available tools: <tools>{tools}</tools> For each function call, return a JSON object with "
          "the function name and arguments within <tool_call></tool_call> tags:\n<tool_call>\n"
          '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


def functions(tools: list[dict]) -> list[dict]:
    """The ``function`` objects of OpenAI's ``tools`` (``{"type": "function", "function": {...}}``)."""
    return [t["function"] for t in tools]


def call_schema(tools: list[dict], name: str | None = None) -> dict:
    """The JSON schema of one call: ``{"name": N, "arguments": <N's parameters>}`` for the function ``name``,
    or any of them (``anyOf``) when ``name`` is None."""
    options = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                 "arguments": f.get("parameters") or {"type": "object"}},
                "required": ["name", "arguments"], "additionalProperties": False}
               for f in functions(tools) if name is None or f["name"] == name]
    return options[0] if len(options) == 1 else {"anyOf": options}


def _arguments(args):
    """A call's ``arguments`` as an object: OpenAI sends JSON text, templates read an object
    (``tool_call.arguments | tojson``), as transformers and vLLM pass it."""
    if isinstance(args, str) and args.strip().startswith("{"):
        try:
            return json.loads(args)
        except ValueError:                  # not JSON after all: the text as it came
            pass
    return args


def for_template(messages: list[dict], tools: list[dict] | None, takes_tools: bool) -> tuple[list[dict], list[dict] | None]:
    """``(messages, tools)`` to render: with ``takes_tools`` the template's own (earlier calls' arguments
    as objects), else :func:`render_messages`' Hermes text and no ``tools``."""
    if not takes_tools:
        return render_messages(messages, tools), None
    out = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": _arguments(c["function"]["arguments"])}}
                                for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]
    return out, tools or None


def render_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """``messages`` as plain ``{"role", "content"}`` turns for a template without tool support: the
    tools in the system message, earlier calls as ``<tool_call>`` text, tool results as the tool's turn."""
    out = []
    for m in messages:
        content = m.get("content") or ""
        for call in m.get("tool_calls") or []:
            fn = call["function"]
            content += ("\n" if content else "") + "<tool_call>\n" \
                + json.dumps({"name": fn["name"], "arguments": _arguments(fn["arguments"])}) + "\n</tool_call>"
        out.append({"role": m["role"], "content": content})
    if tools:
        text = SYSTEM.format(tools=" ".join(json.dumps({"type": "function", "function": f}) for f in functions(tools)))
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {"role": out[0]["role"], "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def parse(text: str) -> tuple[str | None, list[dict]]:
    """``(content, calls)`` of a whole answer, read as a stream reads it (:class:`CallReader`); each call is
    OpenAI's ``{"id", "type": "function", "function": {"name", "arguments": JSON text}}``; content is None
    when the answer was only calls, and the text as it is when it made none."""
    reader = CallReader()
    pieces = reader.feed(text) + reader.flush()
    if not reader.calls:
        return text, []
    content = "".join(p[1] for p in pieces if p[0] == "content").strip()
    return content or None, [{"id": c["id"], "type": "function",
                              "function": {"name": c["name"], "arguments": c["arguments"]}} for c in reader.calls]
