"""The chat-template renderer's worker process: run as a script (``python -I template_worker.py MEMORY PATH``),
it reads one JSON request per line on stdin and writes one JSON answer per line on stdout (``PATH``: the
parent's ``sys.path`` as JSON, so it imports the same jinja2).

It imports jinja2 and nothing of tformer (no torch: it starts in a fraction of a second), caps its own
address space at ``MEMORY`` bytes (``RLIMIT_AS``), so a template that builds a huge string gets a
MemoryError here instead of swapping the machine, and ignores SIGINT (Ctrl-C in a terminal is the
parent's to handle). The parent (:mod:`tformer.tokenizers`) gives each render a deadline and kills the
process when it is past it: a template looping for ever, or a single huge computation such as
``10 ** (10 ** 8)``, which no thread could interrupt.

Once started it writes ``{"ready": true}``. Request: ``{"source", "special", "messages", "tools",
"add_generation_prompt", "max_chars"}`` (``special``: the special tokens by name and the template's own
options). Answer: ``{"text": ...}``, ``{"refused": message}`` (the template's own ``raise_exception``), or ``{"error": "TypeName: message"}``
(anything else the template did: division by zero, a recursive macro, out of memory).
"""

from __future__ import annotations

import json
import signal
import sys

TOO_LONG = "TemplateOutputTooLong"


class Refused(Exception):
    """``raise_exception(message)`` called by the template."""


class TooLong(Exception):
    """The rendered text passed ``max_chars``."""


def environment():
    """The environment transformers' ``apply_chat_template`` renders in: jinja2's immutable sandbox (no Python
    attributes, no mutation of the inputs), ``trim_blocks`` and ``lstrip_blocks``, loop controls
    (``{% break %}``), ``tojson`` as transformers writes it (no ASCII escaping, keys in their order),
    ``raise_exception`` and ``strftime_now``."""
    from datetime import datetime

    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise Refused(str(message))

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)      # Llama 3's templates use it
    return env


def render(env, cache: dict, request: dict) -> dict:
    source = request["source"]
    template = cache.get(source)
    if template is None:
        if len(cache) >= 16:
            cache.clear()
        template = cache[source] = env.from_string(source)
    limit = request["max_chars"]
    parts, size = [], 0
    # the variables transformers' apply_chat_template defines: tools and documents are None when not given
    for piece in template.generate(messages=request["messages"], tools=request.get("tools"),
                                   add_generation_prompt=request["add_generation_prompt"],
                                   **{"documents": None, **request["special"]}):
        size += len(piece)
        if size > limit:
            raise TooLong(str(limit))
        parts.append(piece)
    return {"text": "".join(parts)}


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if len(sys.argv) > 2:
        sys.path[:] = json.loads(sys.argv[2])          # the parent's import path (run with -I, which drops it)
    if len(sys.argv) > 1:
        try:
            import resource

            memory = int(sys.argv[1])
            resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        except (ImportError, ValueError, OSError):
            pass                                   # no such limit here: the deadline still holds
    sys.setrecursionlimit(2000)
    env, cache = environment(), {}
    out = sys.stdout
    out.write('{"ready": true}\n')                     # started: the parent's deadlines count from here
    out.flush()
    for line in sys.stdin:
        try:
            answer = render(env, cache, json.loads(line))
        except Refused as e:
            answer = {"refused": str(e)}
        except TooLong as e:
            answer = {"error": f"{TOO_LONG}: {e}"}
        except MemoryError:
            answer = {"error": "MemoryError: out of memory"}
        except BaseException as e:                  # noqa: BLE001  whatever the template did, in one line
            answer = {"error": f"{type(e).__name__}: {e}"[:500]}
        out.write(json.dumps(answer, ensure_ascii=True) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
