"""Preference data for DPO: JSONL pairs of a preferred and a rejected answer to one prompt, and the
built-in preference task.

Each line is one of (TRL's "standard" and "conversational" preference formats):

    {"prompt": "text", "chosen": "text", "rejected": "text"}
    {"prompt": [messages], "chosen": [{"role": "assistant", "content": ...}], "rejected": [...]}
    {"chosen": [messages ... assistant], "rejected": [messages ... assistant]}       (the prompt implicit:
                                                    every message but the last, the same in both)

A pair becomes two chat examples ``(ids, labels)`` (:func:`tformer.training.chat_data.chat_example`): the
prompt's messages and then the answer as the assistant's message, labelled on the answer's tokens and its
end-of-turn token, as supervised fine-tuning labels them.
"""

from __future__ import annotations

import random
from collections.abc import Collection
from pathlib import Path

from tformer.errors import InputError
from tformer.training.chat_data import ROLES, number_task, read_jsonl

SHAPE = ('each line must be {"prompt": ..., "chosen": ..., "rejected": ...} (strings, or message lists) or '
         '{"chosen": [messages], "rejected": [messages]}')


def _messages(value, where: str, what: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "user" if what == "prompt" else "assistant", "content": value}]
    if not isinstance(value, list) or not value:
        raise InputError(f"{where}: \"{what}\" must be a string or a non-empty list of messages; {SHAPE}.")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise InputError(f"{where}: \"{what}\" message {i + 1} needs a \"role\" ({', '.join(ROLES)}) and a "
                             f"string \"content\"; {SHAPE}.")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def parse_pair(obj, where: str) -> tuple[list[dict], str, str]:
    """``(prompt messages, chosen answer, rejected answer)`` of one JSONL record."""
    if not isinstance(obj, dict) or "chosen" not in obj or "rejected" not in obj:
        raise InputError(f"{where} has no \"chosen\" and \"rejected\"; {SHAPE}.")
    chosen, rejected = _messages(obj["chosen"], where, "chosen"), _messages(obj["rejected"], where, "rejected")
    if "prompt" in obj:
        prompt = _messages(obj["prompt"], where, "prompt")
    else:                                              # the implicit prompt: what the two conversations share
        prompt = chosen[:-1]
        if rejected[:-1] != prompt:
            raise InputError(f"{where}: without a \"prompt\", \"chosen\" and \"rejected\" must be the same "
                             f"conversation up to their last message; {SHAPE}.")
        chosen, rejected = chosen[-1:], rejected[-1:]
    for answer, what in ((chosen, "chosen"), (rejected, "rejected")):
        if len(answer) != 1 or answer[0]["role"] != "assistant":
            raise InputError(f"{where}: \"{what}\" must be one assistant answer; {SHAPE}.")
    if not any(m["role"] == "user" for m in prompt):
        raise InputError(f"{where}: the prompt has no user message to answer; {SHAPE}.")
    return prompt, chosen[0]["content"], rejected[0]["content"]


def read_preferences(path: Path, encoding: str = "utf-8") -> list[tuple[list[dict], str, str]]:
    """The pairs of a JSONL file (blank lines skipped); a bad line is refused by number."""
    pairs = read_jsonl(path, parse_pair, encoding)
    if not pairs:
        raise InputError(f"{path} holds no preference pairs; {SHAPE}.")
    return pairs


def wrong_number(x: int, rng: random.Random, avoid: Collection[int] = ()) -> int | None:
    """``x`` with one of its digits changed (never ``x`` itself, never a leading zero), drawn uniformly among
    those not in ``avoid``; ``None`` if every one is."""
    s = str(x)
    near = [int(s[:i] + d + s[i + 1:]) for i in range(len(s)) for d in "0123456789"
            if d != s[i] and not (i == 0 and d == "0" and len(s) > 1)]
    near = [y for y in near if y not in avoid]
    return rng.choice(near) if near else None


def preference_task(n_train: int, n_test: int, max_number: int, seed: int = 0) -> tuple[list, list]:
    """The built-in preference task: the numbers of :func:`~tformer.training.chat_data.number_task`,
    "Write 437 in French words." with the preferred answer its French words ("quatre cent trente-sept") and the
    rejected one, for every other pair, its English words ("four hundred and thirty-seven") or the French words of
    the number with one digit changed ("quatre cent trente-huit"); ``(train, test)`` pairs, no number in both.

    The changed number is never a held-out number in a training pair, nor a number of a training pair (either
    answer) in a held-out pair, so no held-out answer is taught in training with either label (before, a
    training pair rejecting the French words of a held-out number taught the model to reject that held-out
    pair's right answer); where every one-digit change is excluded, the rejected answer is the English words."""
    from num2words import num2words
    train, test = number_task(n_train, n_test, max_number, seed)
    rng = random.Random(seed + 1)

    held_out = {int(conv[0]["content"].split()[1]) for conv in test}
    taught: set[int] = set()                     # the numbers of the training pairs so far, either answer
    out = []
    for k, conv in enumerate(train + test):
        x = int(conv[0]["content"].split()[1])
        y = None if k % 2 == 0 else wrong_number(x, rng, held_out if k < n_train else taught)
        if k < n_train:
            taught |= {x} if y is None else {x, y}
        out.append((conv[:1], conv[1]["content"], num2words(x, lang="en") if y is None else num2words(y, lang="fr")))
    return out[:n_train], out[n_train:]
