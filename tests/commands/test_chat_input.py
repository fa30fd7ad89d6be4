"""What ``tformer chat`` reads (issue 49, items 19 and 26).

- A pasted text is one message, whole: a paste of 6,000 characters over two lines, pasted into tmux as a
  terminal pastes it (bracketed), is saved whole; the terminal's own line editing cut it at 4,095 characters
  and sent the second line as a message of its own.
- On a Python without readline, a line that reaches the terminal's limit is said to have been cut.
- ``--max-new-tokens`` that leaves the conversation no room in the context is refused before the chat starts
  (every message was refused afterwards, with "more than the -808 the context leaves").
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from types import SimpleNamespace

import pytest

from tests.commands.test_chat import SRC, Terminal, prompts
from tformer.cli import main
from tformer.errors import InputError

needs_tmux = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (.ci/run installs it)")

PASTE = " ".join(f"line{i}" for i in range(1000)) + "\nthe second line of the paste ends HERE"   # ~6,000 chars


def fake_opened(context: int):
    model = SimpleNamespace(config=SimpleNamespace(context_length=context))
    return SimpleNamespace(model=model, tokenizer=object(), template=object(), stop_ids=[2], source="m")


def test_max_new_tokens_beyond_the_context_is_refused_up_front():
    from tformer.commands.chat import Chat

    with pytest.raises(InputError, match=r"--max-new-tokens 100 leaves no room .* context of 64 tokens"):
        Chat(fake_opened(64), None, {}, 100)
    with pytest.raises(InputError, match="leaves no room"):
        Chat(fake_opened(64), None, {}, 64)
    assert Chat(fake_opened(64), None, {}, 63).max_new_tokens == 63


def test_the_default_answer_length_fits_a_short_context():
    from tformer.commands.chat import Chat

    assert Chat(fake_opened(8192), None, {}, None).max_new_tokens == 512
    assert Chat(fake_opened(256), None, {}, None).max_new_tokens == 128


def test_max_new_tokens_below_one_is_refused_before_loading(tmp_path, capsys):
    assert main(["chat", "--model", str(tmp_path / "none.gguf"), "--max-new-tokens", "0", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "tformer chat: error: --max-new-tokens 0 must be at least 1.", err


def test_max_new_tokens_larger_than_smollm2s_context(smollm2, capsys):
    assert main(["chat", "--prompt", "hi", "--max-new-tokens", "9000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]       # (after a first kernel build's note)
    assert err.startswith("tformer chat: error: --max-new-tokens 9000 leaves no room") and "8192" in err, err


def chat_terminal(name: str, tmp_path, pythonpath: str) -> Terminal:
    env = {"PYTHONPATH": pythonpath, "TFORMER_CACHE": os.environ["TFORMER_CACHE"], "HOME": str(tmp_path),
           "TERM": "xterm", "PATH": os.environ.get("PATH", "")}
    term = Terminal(f"{name}-{os.getpid()}", [sys.executable, "-m", "tformer", "chat", "--temperature", "0",
                                              "--max-new-tokens", "1", "--threads", "1"], env)
    term.wait(lambda s: "loaded in" in s and prompts(s) == 1, 180, "the banner and the first prompt")
    return term


def paste(term: Terminal, text: str, tmp_path) -> None:
    """Paste ``text`` as a terminal pastes it: tmux's paste-buffer, bracketed when the program asked for it."""
    import subprocess

    path = tmp_path / "paste.txt"
    path.write_text(text, encoding="utf-8")
    buffer = f"{term.name}-paste"
    subprocess.run(["tmux", "load-buffer", "-b", buffer, str(path)], check=True)
    subprocess.run(["tmux", "paste-buffer", "-p", "-d", "-b", buffer, "-t", term.name], check=True)
    time.sleep(1.0)
    term.keys("Enter")


def saved_messages(term: Terminal, tmp_path) -> list[dict]:
    saved = tmp_path / "history.json"
    term.type(f"/save {saved}")
    term.wait(lambda s: "(saved " in s, 60, "/save")
    return json.loads(saved.read_text(encoding="utf-8"))["messages"]


@needs_tmux
def test_a_long_multi_line_paste_is_one_whole_message(smollm2, tmp_path):
    term = chat_terminal("tformer-paste", tmp_path, SRC)
    try:
        paste(term, PASTE, tmp_path)
        term.wait(lambda s: prompts(s) >= 2, 300, "the answer and the next prompt")
        time.sleep(1.0)
        messages = saved_messages(term, tmp_path)
        users = [m["content"] for m in messages if m["role"] == "user"]
        assert users == [PASTE], [len(u) for u in users]
    finally:
        term.close()


@needs_tmux
def test_without_readline_a_cut_line_is_said_to_be_cut(smollm2, tmp_path):
    """A Python without readline (an ``import readline`` that fails, first on the path) reads the terminal's
    cooked lines: 6,000 characters arrive as 4,095, and the chat says so."""
    blocker = tmp_path / "no_readline"
    blocker.mkdir()
    (blocker / "readline.py").write_text("raise ImportError('no readline here')\n")
    term = chat_terminal("tformer-noreadline", tmp_path, f"{blocker}{os.pathsep}{SRC}")
    try:
        paste(term, PASTE.split("\n")[0], tmp_path)
        screen = term.wait(lambda s: prompts(s) >= 2, 300, "the answer and the next prompt")
        assert "line limit of 4095 characters" in screen, screen
    finally:
        term.close()
