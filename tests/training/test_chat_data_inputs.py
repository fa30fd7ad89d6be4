"""Fine-tuning data with an assistant message and no user turn before it (issue 49, item 27) is refused
naming the data line and the missing user turn; it was blamed on the model's chat template ("use a
prefix-stable template")."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tformer.cli import main
from tformer.errors import InputError
from tformer.training.chat_data import read_chat

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROWS = [{"messages": [{"role": "user", "content": f"Say {i}."}, {"role": "assistant", "content": str(i)}]}
        for i in range(6)]


@pytest.mark.parametrize("messages", [
    [{"role": "assistant", "content": "hello"}],
    [{"role": "system", "content": "Be brief."}, {"role": "assistant", "content": "hello"},
     {"role": "user", "content": "hi"}],
])
def test_read_chat_names_the_line_and_the_missing_user_turn(tmp_path, messages):
    path = tmp_path / "chats.jsonl"
    lines = [json.dumps(r) for r in ROWS]
    lines[2] = json.dumps({"messages": messages})
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(InputError) as e:
        read_chat(path)
    assert f"{path} line 3" in str(e.value) and "no user message before it" in str(e.value), str(e.value)
    assert "template" not in str(e.value)


def test_finetune_on_assistant_only_data_is_one_line(tmp_path, capsys):
    pytest.importorskip("transformers")
    from finetune_fixtures import tiny_llama

    base = tiny_llama(tmp_path / "base")
    capsys.readouterr()                                   # (transformers' progress bar while saving it)
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join([json.dumps(ROWS[0]), json.dumps({"messages": [{"role": "assistant",
                                                                                  "content": "hello"}]})]) + "\n")
    assert main(["finetune", "--model", str(base), "--data", str(path), "--out", str(tmp_path / "run"),
                 "--set", "progress=false", "--set", "threads=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "line 2" in err and "no user message" in err, err
    assert "prefix-stable" not in err
