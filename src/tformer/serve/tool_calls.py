"""A model's answer read as it is written: its text, and the tool calls in it as OpenAI streams them.

:class:`CallReader` takes the answer piece by piece (each token's text) and gives back pieces of three kinds,
the deltas of OpenAI's stream: ``("content", text)``; ``("call", k, id, name)`` the moment call ``k``'s name
is complete; ``("arguments", k, text)`` fragments of its arguments' JSON text as they are written. A whole
answer is read the same way (:func:`tformer.serve.tools.parse`), so a stream and a full response agree.

The formats (the families' templates): Hermes / Qwen ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
anywhere in the answer, one or more; Llama 3.x's bare ``{"name": ..., "parameters": {...}}`` (after
``<|python_tag|>`` or not) and the generic ``{"name": ..., "arguments": ...}`` as the whole answer. A call is
streamed once its header ``{"name": "<name>", "arguments":`` is whole, then its arguments object character by
character up to the brace that closes it (a scan of JSON's strings, escapes and nesting). A call written
otherwise (``arguments`` first, arguments as JSON text) is held until it ends and read as one JSON value;
text that turns out not to be a call (malformed JSON, an object without ``name``) is given back as content.
Text that could still be the start of ``<tool_call>`` is held back until it is not, and so is whitespace,
which is not content when a call follows it.
"""

from __future__ import annotations

import json
import uuid

OPEN, CLOSE, PYTHON_TAG = "<tool_call>", "</tool_call>", "<|python_tag|>"
MAYBE, NO = "maybe", "no"           # a prefix that may still become a call header / one that cannot
WS = " \t\r\n"


def _skip(s: str, i: int) -> int:
    while i < len(s) and s[i] in WS:
        i += 1
    return i


def _literal(s: str, i: int, words: tuple[str, ...]):
    """The index after whichever of ``words`` starts at ``s[i]``; MAYBE when ``s`` ends inside one; NO otherwise."""
    rest = s[i:]
    for w in words:
        if rest.startswith(w):
            return i + len(w)
    return MAYBE if any(w.startswith(rest) for w in words) else NO


def _string(s: str, i: int):
    """``(index after it, value)`` of the JSON string opening at ``s[i]``; MAYBE unfinished; NO not a string."""
    if i == len(s):
        return MAYBE
    if s[i] != '"':
        return NO
    j = i + 1
    while j < len(s):
        if s[j] == "\\":
            j += 2
            continue
        if s[j] == '"':
            try:
                return j + 1, json.loads(s[i:j + 1])
            except ValueError:
                return NO
        j += 1
    return MAYBE


def header(s: str):
    """``(name, index where the arguments value starts)`` when ``s`` opens ``{"name": "<name>", "arguments":``
    (or ``"parameters"``, Llama 3.x's key; whitespace anywhere JSON allows it), else MAYBE or NO."""
    i = 0
    for words in (("{",), ('"name"',), (":",)):
        i = _literal(s, _skip(s, i), words)
        if not isinstance(i, int):
            return i
    got = _string(s, _skip(s, i))
    if not isinstance(got, tuple):
        return got
    i, name = got
    for words in ((",",), ('"arguments"', '"parameters"'), (":",)):
        i = _literal(s, _skip(s, i), words)
        if not isinstance(i, int):
            return i
    return name, i


class ObjectEnd:
    """Where a JSON object ends, found as its text arrives: nesting depth outside strings, and escapes."""

    def __init__(self):
        self.depth, self.in_string, self.escaped = 0, False, False

    def feed(self, s: str) -> int | None:
        """The index in ``s`` just after the object's closing brace, or None while it is still open."""
        for i, ch in enumerate(s):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


def whole_call(body: str) -> dict | None:
    """``{"name", "arguments": dict}`` from a call's whole JSON text in any of the formats, or None."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):                 # arguments sent as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return {"name": obj["name"], "arguments": args if isinstance(args, dict) else {}}


class CallReader:
    """Read one answer's text as it arrives (:meth:`feed`, then :meth:`flush` at its end).

    States: ``start`` (only whitespace so far: a bare JSON call may begin), ``text`` (content, watching for
    ``<tool_call>``), ``header`` (inside a call, its name not yet whole), ``arguments`` (streaming the
    arguments object), ``after`` (the object closed: skipping to the call's end), ``hold`` (a call written
    another way: kept whole until it ends).
    """

    def __init__(self):
        self.state, self.buf = "start", ""
        self.tagged = False          # the current call opened with <tool_call> (else: the whole answer is one)
        self.opened = ""             # the text that opened it (<tool_call>, <|python_tag|>), given back if not a call
        self.calls: list[dict] = []  # {"id", "name", "arguments": JSON text so far}
        self.scan: ObjectEnd | None = None
        self.searched = 0            # where </tool_call> may still start in buf (it was looked for before that)

    # ---------------------------------------------------------------- output
    def _content(self, out: list, text: str) -> None:
        if text:
            out.append(("content", text))

    def _open_call(self, out: list, name: str) -> None:
        self.calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "name": name, "arguments": ""})
        out.append(("call", len(self.calls) - 1, self.calls[-1]["id"], name))

    def _arguments(self, out: list, text: str) -> None:
        if text:
            self.calls[-1]["arguments"] += text
            out.append(("arguments", len(self.calls) - 1, text))

    def _finish_whole(self, out: list, body: str, opened: str, closed: str) -> None:
        """A held call's whole text: one call, or given back as content when it is not one."""
        call = whole_call(body.strip())
        if call is None:
            self._content(out, opened + body + closed)
            return
        self._open_call(out, call["name"])
        self._arguments(out, json.dumps(call["arguments"]))

    def _close(self, s: str) -> int:
        """Where ``</tool_call>`` starts in the held text ``s``, or -1; each token's text is searched once,
        not the whole held text again (a long held call would be quadratic)."""
        at = s.find(CLOSE, self.searched)
        self.searched = 0 if at >= 0 else max(0, len(s) - len(CLOSE) + 1)
        return at

    # ----------------------------------------------------------------- input
    def feed(self, text: str) -> list[tuple]:
        self.buf += text
        out: list[tuple] = []
        while self._step(out):
            pass
        return out

    def _step(self, out: list) -> bool:
        """Advance one state on the held text; True when it should be called again."""
        s = self.buf
        if self.state == "start":
            body = s.lstrip(WS)
            if not body:
                return False
            if body.startswith(PYTHON_TAG):
                self.buf, self.opened, self.state = body[len(PYTHON_TAG):], PYTHON_TAG, "header"
                return True
            if PYTHON_TAG.startswith(body):
                return False
            if body.startswith("{"):
                self.buf, self.state = body, "header"
            else:
                self.state = "text"                # the leading whitespace stays content
            return True
        if self.state == "text":                   # whitespace before a call is not content: held too
            at = s.find(OPEN)
            if at >= 0:
                self._content(out, s[:at].rstrip(WS))
                self.buf, self.tagged, self.opened, self.state = s[at + len(OPEN):], True, OPEN, "header"
                return True
            partial = next((k for k in range(len(OPEN) - 1, 0, -1) if s.endswith(OPEN[:k])), 0)  # "<tool_c"
            cut = len(s[:len(s) - partial].rstrip(WS))          # ... and the whitespace before it: held
            self._content(out, s[:cut])
            self.buf = s[cut:]
            return False
        if self.state == "header":
            got = header(s)
            if got == MAYBE:
                return False
            if got == NO:
                self.state = "hold"
                return True
            name, i = got
            start = _skip(s, i)
            if start == len(s):
                return False                       # the arguments' first character decides how they are read
            if s[start] != "{":
                self.state = "hold"
                return True
            self._open_call(out, name)
            self.buf, self.scan, self.state = s[start:], ObjectEnd(), "arguments"
            return True
        if self.state == "arguments":
            end = self.scan.feed(s)
            self._arguments(out, s if end is None else s[:end])
            self.buf = "" if end is None else s[end:]
            if end is not None:
                self.state = "after"
            return end is not None
        if self.state == "after":                  # the call's own closing brace, then </tool_call>
            if not self.tagged:
                rest = s.lstrip(WS)
                if rest.startswith("}"):
                    rest = rest[1:]
                elif not rest:
                    return False
                self.buf, self.state = rest.lstrip(WS), "text"
                return True
            at = self._close(s)
            if at < 0:
                return False
            self.buf, self.tagged, self.state = s[at + len(CLOSE):].lstrip(WS), False, "text"
            return True
        # hold: a tagged call ends at </tool_call>; a bare one at the answer's end (flush)
        at = self._close(s) if self.tagged else -1
        if at < 0:
            return False
        self._finish_whole(out, s[:at], self.opened, CLOSE)
        self.buf, self.tagged, self.state = s[at + len(CLOSE):].lstrip(WS), False, "text"
        return True

    def flush(self) -> list[tuple]:
        """What is held at the end of the answer: content, a held call read whole, or a cut-off call's
        last arguments (left as written: a call cut by ``max_tokens`` has unfinished JSON, as OpenAI's)."""
        out: list[tuple] = []
        s, self.buf, self.searched = self.buf, "", 0
        if self.state in ("start", "text"):
            self._content(out, s.rstrip(WS) if self.calls else s)       # trailing whitespace, as parse() strips it
        elif self.state in ("header", "hold"):
            self._finish_whole(out, s, self.opened, "")
        elif self.state == "arguments":
            self._arguments(out, s)
        elif self.state == "after" and not self.tagged:
            self._content(out, s.lstrip(WS).removeprefix("}").strip(WS))
        self.state = "text"
        return out
