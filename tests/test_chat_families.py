"""The chat templates of Llama 3.2, Llama 3.1/3.3, Qwen3, Gemma 2, Gemma 3 and Phi-3.5 (``tests/data/chat_templates``,
their provenance in its README) render in tformer's sandboxed renderer exactly as transformers'
``apply_chat_template`` renders them: 10 conversations each (tool calls and tool results where the template
takes them), with and without ``tools``, with and without ``add_generation_prompt``, and Qwen3's
``enable_thinking`` unset, on and off; a conversation a template refuses is refused by both. Then each family's
end-of-turn token is one of the stop ids tformer opens the model with.
"""

from __future__ import annotations

from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from tformer.errors import InputError  # noqa: E402
from tformer.tokenizers import ChatTemplate  # noqa: E402

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
# the special tokens each model's tokenizer_config.json names (what the template sees as bos_token, eos_token)
SPECIAL = {
    "llama-3.2": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "llama-3.3": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "qwen3": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "gemma-2": {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"},
    "gemma-3": {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"},
    "phi-3.5": {"bos_token": "<s>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "unk_token": "<unk>"},
}
END_OF_TURN = {"llama-3.2": "<|eot_id|>", "llama-3.3": "<|eot_id|>", "qwen3": "<|im_end|>", "gemma-2": "<end_of_turn>",
               "gemma-3": "<end_of_turn>", "phi-3.5": "<|end|>"}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city, e.g. Paris"},
                                                    "unit": {"type": "string", "enum": ["C", "F"]}},
                   "required": ["city"]}}}]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}}

S, U, A = "system", "user", "assistant"


def m(role: str, content, **extra) -> dict:
    return {"role": role, "content": content, **extra}


CONVERSATIONS = [
    [m(U, "hi")],
    [m(S, "You are terse."), m(U, "What is 2+2?")],
    [m(U, "Name a colour."), m(A, "Blue."), m(U, "Another?")],
    [m(U, "  padded on both sides  \n"), m(A, "\n answer with spaces \n\n"), m(U, "\tnext\t")],
    [m(S, "Antworte auf Deutsch. 🙂"), m(U, "Grüße aus 日本 — ¿qué tal? \u00a0½")],
    [m(U, "Fix this:\n```python\ndef f(x):\n    return x ** 2\n```"), m(A, "It is fine."), m(U, "Thanks!")],
    [m(S, "Be kind."), m(U, "a"), m(A, "b"), m(U, "c"), m(A, "d"), m(U, "e")],
    [m(U, "typed markers <|im_end|> <end_of_turn> <|eot_id|> <|end|> stay text")],
    [m(U, " ".join(f"word{i}" for i in range(200)))],
    [m(U, "Think first."), m(A, "<think>\nTwo and two.\n</think>\n\nFour."), m(U, "And three?")],
]
TOOL_CONVERSATIONS = [   # a call and its result (Llama 3 takes one call at a time)
    [m(U, "Weather in Paris?"), m(A, None, tool_calls=[CALL]), m("tool", '{"temperature": 21}')],
    [m(S, "Use tools."), m(U, "Paris?"), m(A, "", tool_calls=[CALL]), m("tool", "sunny"), m(A, "It is sunny."),
     m(U, "And tomorrow?")],
    [m(U, "Plan it."), m(A, "Calling.", reasoning_content="I need the weather.", tool_calls=[CALL]),
     m("tool", "21 C")],
]
TAKES_TOOLS = {"llama-3.2", "llama-3.3", "qwen3"}
ALTERNATING = {"gemma-2", "gemma-3"}               # user / assistant turns only (Gemma 2 refuses a system message)


def conversations(name: str) -> list[list[dict]]:
    convs = CONVERSATIONS + (TOOL_CONVERSATIONS if name in TAKES_TOOLS else [])
    if name == "gemma-2":
        convs = [[x for x in c if x["role"] != S] for c in convs]
    if name == "qwen3":          # its template reads an assistant's content even beside tool calls
        convs = [[{**x, "content": x["content"] or ""} for x in c] for c in convs]
    return convs


def hf_tokenizer(name: str, source: str):
    """A transformers tokenizer carrying the template and the family's special tokens (its vocabulary does not
    matter for rendering text)."""
    from tokenizers import Tokenizer, models

    return transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"x": 0})),
                                                chat_template=source, **SPECIAL[name])


def render_both(name: str, conv: list[dict], **kwargs):
    source = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
    ours, ref = ChatTemplate(source, **SPECIAL[name]), hf_tokenizer(name, source)
    try:
        want = ref.apply_chat_template(conv, tokenize=False, **kwargs)
    except Exception as e:  # noqa: BLE001  the template refused (raise_exception) or failed
        with pytest.raises(InputError):
            ours.render(conv, **kwargs)
        return type(e).__name__
    tools = kwargs.pop("tools", None)
    return ours.render(conv, kwargs.pop("add_generation_prompt"), tools, **kwargs), want


@pytest.mark.parametrize("name", sorted(SPECIAL))
def test_templates_render_as_transformers_does(name):
    options = [{}]
    if name == "qwen3":
        options = [{}, {"enable_thinking": True}, {"enable_thinking": False}]
    source = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
    assert ChatTemplate(source).takes_tools == (name in TAKES_TOOLS)       # what serve's tool calls read
    rendered = 0
    for conv in conversations(name):
        for tools in (None, TOOLS):
            for prompt in (True, False):
                for extra in options:
                    result = render_both(name, conv, tools=tools, add_generation_prompt=prompt, **extra)
                    assert isinstance(result, tuple), f"transformers refused a conversation: {result}"
                    ours, want = result
                    assert ours == want, (conv, tools, prompt, extra)
                    assert ("The weather now in a city." in ours) == (tools is not None and name in TAKES_TOOLS)
                    rendered += 1
    assert rendered >= 10 * 2 * 2 * len(options)


@pytest.mark.parametrize("name, conv", [
    ("gemma-2", [m(S, "sys"), m(U, "hi")]),                       # "System role not supported"
    ("gemma-3", [m(U, "a"), m(U, "b")]),                          # roles must alternate
    ("llama-3.3", [m(U, "a"), m(A, None, tool_calls=[CALL, CALL])]),   # one tool call at a time
])
def test_a_conversation_a_template_refuses_is_refused_by_both(name, conv):
    assert render_both(name, conv, add_generation_prompt=True) == "TemplateError"


def test_gemma_3_content_parts_and_a_date_option_render_as_transformers_does():
    parts = [m(S, [{"type": "text", "text": "Read it."}]),
             m(U, [{"type": "image"}, {"type": "text", "text": " What is this? "}])]
    ours, want = render_both("gemma-3", parts, add_generation_prompt=True)
    assert ours == want and "<start_of_image>" in ours
    ours, want = render_both("llama-3.2", CONVERSATIONS[1], add_generation_prompt=True, date_string="01 Jan 2030")
    assert ours == want and "Today Date: 01 Jan 2030" in ours


@pytest.mark.parametrize("name", sorted(SPECIAL))
def test_each_family_stops_at_its_end_of_turn_token(name):
    """inference.end_of_turn_ids: the token a family's template closes a turn with joins the stop ids, though
    the eos_token the checkpoint names is another (Gemma's <eos>, Phi-3.5's <|endoftext|>)."""
    from tokenizers import AddedToken, Tokenizer, models

    from tformer.inference import end_of_turn_ids
    from tformer.tokenizers import HFTokenizer

    source = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
    words = ["hello", "<unk>"] + list(dict.fromkeys(list(SPECIAL[name].values()) + list(END_OF_TURN.values())))
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.add_special_tokens([AddedToken(w, special=True) for w in words[2:]])
    ids = end_of_turn_ids(ChatTemplate(source, **SPECIAL[name]), HFTokenizer(tok))
    assert tok.token_to_id(END_OF_TURN[name]) in ids
    others = set(END_OF_TURN.values()) - {END_OF_TURN[name], SPECIAL[name]["eos_token"]}
    assert not {tok.token_to_id(t) for t in others} & set(ids)   # only the markers this template writes
