"""``tformer chat`` with SmolLM2-135M-Instruct, used as a person uses it.

- ``--prompt``: one greedy answer on stdout, knowing what a 135M model knows (Paris);
- in a terminal, under tmux (keys sent, the screen read back): a question and its streamed answer,
  Ctrl-C stopping a long answer without leaving, ``/save`` writing the history, ``/reset`` clearing it,
  ``/exit`` leaving;
- the conversation kept between turns and ``--system`` replacing the template's default system message;
- a model that is not there: one sentence, exit 2.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tformer
from tformer.cli import main

SRC = str(Path(tformer.__file__).resolve().parents[1])


def test_one_turn_with_prompt(smollm2, capsys):
    assert main(["chat", "--prompt", "What is the capital of France? Answer in one word.", "--temperature", "0",
                 "--max-new-tokens", "16"]) == 0
    out, err = capsys.readouterr()
    assert "Paris" in out, out
    assert "tokens in" in err and "model loaded in" in err


def test_history_and_system_message(smollm2):
    from tformer.commands.chat import Chat
    from tformer.inference import open_model

    chat = Chat(open_model("smollm2"), None, {"temperature": 0.0}, max_new_tokens=2)
    out = io.StringIO()
    chat.answer("My name is Ada.", out)
    chat.answer("What is my name?", out)
    assert [m["role"] for m in chat.messages] == ["user", "assistant", "user", "assistant"]
    text = chat.template.render(chat.messages)
    assert text.index("My name is Ada.") < text.index("What is my name?")          # both turns in the prompt
    assert "named SmolLM" in text                                                   # the template's default system
    chat.reset()
    assert chat.messages == []
    chat.system = "You are terse."                  # what --system sets
    chat.reset()
    chat.answer("Hi", out)
    assert [m["role"] for m in chat.messages] == ["system", "user", "assistant"]
    text = chat.template.render(chat.messages)
    assert text.startswith("<|im_start|>system\nYou are terse.<|im_end|>") and "named SmolLM" not in text

    # A conversation longer than the context leaves out its oldest turns, never the system message.
    chat.messages += [{"role": "user", "content": "word " * 40}, {"role": "assistant", "content": "ok"},
                      {"role": "user", "content": "Last question?"}]
    full = len(chat.template.encode(chat.tokenizer, chat.messages))
    chat.max_new_tokens = chat.model.config.context_length - (full - 30)       # room for all but ~30 tokens
    ids = chat.prompt_ids()
    text = chat.tokenizer.decode(ids)
    assert len(ids) <= full - 30 and "You are terse." in text and "Last question?" in text and "word word" not in text
    chat.max_new_tokens = chat.model.config.context_length - 5                  # not even the last message fits
    from tformer.errors import InputError
    with pytest.raises(InputError, match="send a shorter one"):
        chat.prompt_ids()


def test_a_missing_model_is_one_sentence(tmp_path, capsys):
    assert main(["chat", "--model", str(tmp_path / "nothing.gguf"), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "neither a built-in model" in err, err


class Terminal:
    """One tmux session running a command, 120 x 40 characters."""

    def __init__(self, name: str, command: list[str], env: dict):
        self.name = name
        exports = " ".join(f"{k}={shlex_quote(v)}" for k, v in env.items())
        line = f"env {exports} " + " ".join(shlex_quote(c) for c in command)
        line += '; echo "[exited $?]"; sleep 3600'          # keep the screen readable after the command ends
        subprocess.run(["tmux", "new-session", "-d", "-s", name, "-x", "120", "-y", "40", line], check=True)

    def screen(self) -> str:
        r = subprocess.run(["tmux", "capture-pane", "-p", "-J", "-t", self.name, "-S", "-500"], capture_output=True,
                           text=True)
        return r.stdout

    def keys(self, *keys: str) -> None:
        subprocess.run(["tmux", "send-keys", "-t", self.name, *keys], check=True)

    def type(self, text: str) -> None:
        subprocess.run(["tmux", "send-keys", "-t", self.name, "-l", text], check=True)
        self.keys("Enter")

    def wait(self, predicate, timeout: float, what: str) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            screen = self.screen()
            if predicate(screen):
                return screen
            if not self.alive():
                break
            time.sleep(0.3)
        raise AssertionError(f"timed out waiting for {what}; the screen:\n{self.screen()}")

    def alive(self) -> bool:
        return "[exited " not in self.screen()

    def close(self) -> None:
        subprocess.run(["tmux", "kill-session", "-t", self.name], capture_output=True)


def shlex_quote(s: str) -> str:
    import shlex
    return shlex.quote(s)


def prompts(screen: str) -> int:
    """How many ``> `` input prompts the screen shows (one more each time the chat waits for a line)."""
    return sum(1 for line in screen.splitlines() if line.startswith(">"))


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (.ci/run installs it)")
def test_interactive_chat_in_a_terminal(smollm2, tmp_path):
    env = {"PYTHONPATH": SRC, "TFORMER_CACHE": os.environ["TFORMER_CACHE"], "HOME": str(tmp_path),
           "TERM": "xterm", "PATH": os.environ.get("PATH", "")}
    term = Terminal(f"tformer-chat-{os.getpid()}", [sys.executable, "-m", "tformer", "chat", "--temperature", "0",
                                                    "--max-new-tokens", "2000", "--threads", "1"], env)
    try:
        term.wait(lambda s: "loaded in" in s and prompts(s) == 1, 180, "the banner and the first prompt")
        term.type("What is the capital of France? Answer in one word.")
        screen = term.wait(lambda s: prompts(s) == 2, 180, "the answer and the next prompt")
        answer = screen.split("Answer in one word.", 1)[1]
        assert "Paris" in answer, screen

        term.type("Write a very long story about a dragon who learns to cook, with many chapters.")
        term.wait(lambda s: len(s.split("many chapters.", 1)[-1].strip()) > 20, 180, "the story to begin")
        term.keys("C-c")            # 2,000 new tokens at most: the story cannot end before a slow poll sends this
        screen = term.wait(lambda s: "[stopped]" in s and prompts(s) == 3, 60, "Ctrl-C to stop the answer")
        assert term.alive()

        saved = tmp_path / "history.json"
        term.type(f"/save {saved}")
        term.wait(lambda s: "saved 4 messages" in s, 30, "/save")
        messages = json.loads(saved.read_text(encoding="utf-8"))["messages"]
        assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
        assert "Paris" in messages[1]["content"] and messages[3]["content"]     # the stopped answer is kept

        term.type("/reset")
        term.wait(lambda s: "(conversation cleared)" in s, 30, "/reset")
        term.type(f"/save {tmp_path / 'empty.json'}")
        term.wait(lambda s: "saved 0 messages" in s, 30, "/save after /reset")

        term.type("/exit")
        deadline = time.monotonic() + 30
        while term.alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "[exited 0]" in term.screen(), term.screen()
    finally:
        term.close()


def test_generate_takes_the_built_in_model(smollm2, capsys):
    """`tformer generate --model smollm2` continues plain text with the real weights (greedy)."""
    assert main(["generate", "--model", "smollm2", "--prompt", "The capital of France is", "--max-new-tokens", "4",
                 "--temperature", "0"]) == 0
    assert "Paris" in capsys.readouterr().out


def test_generate_needs_exactly_one_model(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--prompt", "x"])
    assert "--ckpt" in capsys.readouterr().err
