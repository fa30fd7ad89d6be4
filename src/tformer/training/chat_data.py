"""Fine-tuning data: chat JSONL rendered with the model's chat template (the loss on the assistant's
tokens only), plain text (every token), and the built-in chat numbers task.

An example is ``(ids, labels)``, two equal-length int lists; ``labels[t]`` is ``ids[t]`` where the
token is trained on and ``-100`` where it is not (the prompt). The model sees ``ids[:-1]`` and is
scored on ``labels[1:]``.

Chat masking renders the conversation one message at a time with the template and tokenises each
new piece of text on its own::

    render(messages[:k])                                   everything before message k
    render(messages[:k], add_generation_prompt=True)       ... + the assistant header (masked)
    render(messages[:k + 1])                               ... + the answer and its end token (trained on)

which needs a template whose renderings of a conversation's prefixes are prefixes of each other
(ChatML, Llama 3, SmolLM2's and most are); another template is refused with one sentence.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from tformer.errors import InputError

IGNORE = -100
ROLES = ("system", "user", "assistant", "tool")

# ChatML (OpenAI, Qwen, SmolLM2), for a checkpoint that carries no template of its own.
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@dataclass
class ChatTemplate:
    """A chat template with the ``bos_token`` / ``eos_token`` strings HF templates read, rendered by the one
    renderer chat and serve use (:class:`tformer.tokenizers.ChatTemplate`: jinja2's immutable sandbox in a
    bounded process, transformers' ``tojson``, ``{% break %}``, ``strftime_now``), so fine-tuning trains on
    the text the server renders. Kept as a dataclass: a fine-tuning run saves its fields."""

    source: str = CHATML
    bos_token: str = ""
    eos_token: str = ""

    def renderer(self):
        from tformer.tokenizers import ChatTemplate as Renderer

        key = (self.source, self.bos_token, self.eos_token)
        if getattr(self, "_key", None) != key:
            self._renderer, self._key = Renderer(self.source, bos_token=self.bos_token, eos_token=self.eos_token), key
        return self._renderer

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.renderer().render(messages, add_generation_prompt)


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` without the tokenizer's own BOS/EOS additions (special tokens written in
    the text, such as ``<|im_start|>``, are recognised)."""
    inner = getattr(tokenizer, "tok", None)
    if inner is not None and hasattr(inner, "encode"):               # a HuggingFace tokenizers.Tokenizer
        return list(inner.encode(text, add_special_tokens=False).ids)
    return list(tokenizer.encode(text))


def chat_example(messages: list[dict], template: ChatTemplate, tokenizer) -> tuple[list[int], list[int]]:
    """``(ids, labels)`` of one conversation: the assistant messages (and their end tokens) are
    labelled, everything else is ``-100``."""
    ids: list[int] = []
    labels: list[int] = []
    done = ""

    def add(text: str, train: bool) -> None:
        nonlocal done
        if not text.startswith(done):
            raise InputError("the model's chat template renders a conversation's beginning differently once it "
                             "goes on, so the answers cannot be told apart; use a prefix-stable template (ChatML).")
        piece = encode(tokenizer, text[len(done):])
        ids.extend(piece)
        labels.extend(piece if train else [IGNORE] * len(piece))
        done = text

    for k, m in enumerate(messages):
        if m["role"] == "assistant":
            add(template.render(messages[:k], add_generation_prompt=True), False)
            add(template.render(messages[:k + 1]), True)
        else:
            add(template.render(messages[:k + 1]), False)
    return ids, labels


def check_messages(obj, where: str) -> list[dict]:
    """The ``messages`` of one JSONL record, or an InputError naming ``where`` and the problem."""
    shape = ('each line must be {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", '
             '"content": "..."}]}')
    if not isinstance(obj, dict) or not isinstance(obj.get("messages"), list) or not obj["messages"]:
        raise InputError(f"{where} has no non-empty \"messages\" list; {shape}.")
    for i, m in enumerate(obj["messages"]):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise InputError(f"{where}: message {i + 1} needs a \"role\" ({', '.join(ROLES)}) and a string "
                             f"\"content\"; {shape}.")
    if not any(m["role"] == "assistant" for m in obj["messages"]):
        raise InputError(f"{where} has no assistant message, so nothing to learn; {shape}.")
    first = next(i for i, m in enumerate(obj["messages"]) if m["role"] == "assistant")
    if not any(m["role"] == "user" for m in obj["messages"][:first]):
        raise InputError(f"{where}: message {first + 1} is an assistant message with no user message before it; an "
                         f"answer is learnt as the reply to a user turn, so add the user message it answers; {shape}.")
    return [{"role": m["role"], "content": m["content"]} for m in obj["messages"]]


def read_jsonl(path: Path, check, encoding: str = "utf-8") -> list:
    """``check(obj, where)`` of each line of a JSONL file (blank lines skipped); a line that is not JSON is
    refused by number (``where`` names the file and line for ``check``'s own refusals)."""
    try:
        lines = path.read_text(encoding=encoding).splitlines()
    except UnicodeDecodeError as e:
        raise InputError(f"{path} is not {encoding} text ({e.reason} at byte {e.start}); pass --set encoding=...") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise InputError(f"{path} line {n} is not JSON ({e.msg} at column {e.colno}); write one JSON object "
                             f"per line.") from None
        out.append(check(obj, f"{path} line {n}"))
    return out


def read_chat(path: Path, encoding: str = "utf-8") -> list[list[dict]]:
    """The conversations of a JSONL file (blank lines skipped); a bad line is refused by number."""
    convs = read_jsonl(path, check_messages, encoding)
    if not convs:
        raise InputError(f"{path} holds no conversations; write one {{\"messages\": [...]}} object per line.")
    return convs


def text_examples(text: str, tokenizer, length: int) -> list[tuple[list[int], list[int]]]:
    """Plain text (continued pre-training): consecutive windows of ``length + 1`` tokens, all labelled."""
    ids = encode(tokenizer, text)
    if len(ids) < length + 1:
        length = len(ids) - 1
    if length < 1:
        raise InputError("the text file holds fewer than 2 tokens; pass a longer text.")
    return [(ids[i:i + length + 1], ids[i:i + length + 1]) for i in range(0, len(ids) - length, length + 1)]


def number_task(n_train: int, n_test: int, max_number: int, seed: int = 0) -> tuple[list, list]:
    """The built-in task: ``(train, test)`` conversations "Write 4372 in French words." ->
    "quatre mille trois cent soixante-douze" (``num2words``), distinct numbers in ``0..max_number``,
    none in both splits; the number of digits is uniform so every length is represented."""
    try:
        from num2words import num2words
    except ImportError:
        raise InputError("the built-in task needs num2words; pip install num2words, or pass --data FILE.") from None
    if n_train + n_test > max_number + 1:
        raise InputError(f"{n_train + n_test} distinct numbers do not exist up to {max_number}; ask for fewer.")
    rng, seen, numbers = random.Random(seed), set(), []
    digits = len(str(max_number))
    while len(numbers) < n_train + n_test:
        d = rng.randint(1, digits)
        x = rng.randint(0 if d == 1 else 10 ** (d - 1), min(10 ** d - 1, max_number))
        if x not in seen:
            seen.add(x)
            numbers.append(x)
    convs = [[{"role": "user", "content": f"Write {x} in French words."},
              {"role": "assistant", "content": num2words(x, lang="fr")}] for x in numbers]
    return convs[:n_train], convs[n_train:]


def truncate(example: tuple[list[int], list[int]], length: int) -> tuple[list[int], list[int]]:
    """The first ``length + 1`` tokens (the model sees ``length``)."""
    ids, labels = example
    return ids[:length + 1], labels[:length + 1]
