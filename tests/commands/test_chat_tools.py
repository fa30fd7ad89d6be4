"""``tformer chat --tools FILE.json`` used as a person uses it: the functions rendered through the model's
template, a call in the answer printed parsed, ``/tool RESULT`` sending the result back for the next answer.

The model is the random-weight Qwen3 of ``tests/interop/families.py`` with its tools template (``QWEN3_TOOLS_CHAT``);
its answers are fixed model outputs (a random model makes no call of its own), so what is tested is the
command: each prompt it builds equals transformers' ``apply_chat_template`` of the same conversation and tools
(ids, the independent reference), and what it prints. SmolLM2 (a template without tools: the Hermes text in the
system message) answers one real turn with ``--tools``."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from tformer.cli import main

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "interop"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serve"))
import families as F  # noqa: E402
from tools_util import TIME, WEATHER  # noqa: E402

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
AFTER = "It is 21 degrees in Paris."


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    folder = F.hf_folder("qwen3-0.6b", tmp_path_factory.mktemp("qwen3-chat-tools"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": F.QWEN3_TOOLS_CHAT,
                                                              "eos_token": "<|im_end|>"}), encoding="utf-8")
    (folder / "tools.json").write_text(json.dumps([WEATHER, TIME]), encoding="utf-8")
    return folder


def test_a_call_printed_and_its_result_sent_back(qwen3, monkeypatch, capsys):
    import torch
    from transformers import PreTrainedTokenizerFast

    import tformer.generation.generate as generation

    hf = PreTrainedTokenizerFast(tokenizer_file=str(qwen3 / "tokenizer.json"), chat_template=F.QWEN3_TOOLS_CHAT)
    end = hf.convert_tokens_to_ids("<|im_end|>")
    answers, prompts = [CALL, AFTER], []

    def fixed(model, ids, max_new_tokens, **options):     # the model's answers: fixed outputs, then end of turn
        prompts.append(ids[0].tolist())
        for t in hf.encode(answers[len(prompts) - 1], add_special_tokens=False) + [end]:
            yield torch.tensor([t])
    monkeypatch.setattr(generation, "generate_tokens", fixed)
    monkeypatch.setattr("sys.stdin", io.StringIO('What is the weather in Paris?\n/tool {"temp": 21}\n'))
    assert main(["chat", "--model", str(qwen3), "--tools", str(qwen3 / "tools.json")]) == 0
    out = capsys.readouterr().out
    assert '[tool call] get_weather {"city": "Paris", "unit": "celsius"}' in out and AFTER in out

    user = {"role": "user", "content": "What is the weather in Paris?"}
    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]}
    result = {"role": "tool", "content": '{"temp": 21}'}
    for got, conversation in zip(prompts, [[user], [user, call, result]]):
        want = hf.apply_chat_template(conversation, tools=[WEATHER, TIME], add_generation_prompt=True, tokenize=True,
                                      return_dict=False)
        assert got == list(want), (hf.decode(got), hf.decode(want))


def test_tool_without_a_call_and_a_bad_tools_file(qwen3, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("/tool 21\n"))
    assert main(["chat", "--model", str(qwen3), "--tools", str(qwen3 / "tools.json")]) == 0
    assert "error: the model has made no tool call to answer" in capsys.readouterr().out
    for text, says in [("{not json", "is not JSON"), ('[{"type": "function"}]', "must be a JSON list of tools")]:
        (tmp_path / "t.json").write_text(text, encoding="utf-8")
        assert main(["chat", "--model", str(qwen3), "--tools", str(tmp_path / "t.json"), "--prompt", "hi"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and says in err, err
    assert main(["chat", "--tools", str(tmp_path / "missing.json"), "--prompt", "hi"]) == 2
    assert "cannot read it" in capsys.readouterr().err


def test_smollm2_answers_with_tools_shown(smollm2, tmp_path, capsys):
    from tformer.commands.chat import Chat
    from tformer.inference import open_model

    chat = Chat(open_model("smollm2"), None, {"temperature": 0.0}, max_new_tokens=8, tools=[WEATHER])
    chat.messages.append({"role": "user", "content": "Weather in Paris?"})
    text = chat.tokenizer.decode(chat.prompt_ids())
    assert "<tools>" in text and '"name": "get_weather"' in text         # the Hermes text: ChatML has no tools
    (tmp_path / "tools.json").write_text(json.dumps([WEATHER]), encoding="utf-8")
    assert main(["chat", "--tools", str(tmp_path / "tools.json"), "--prompt", "Weather in Paris?", "--temperature", "0",
                 "--max-new-tokens", "24"]) == 0
    assert capsys.readouterr().out.strip()
