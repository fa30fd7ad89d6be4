"""OpenAI's Responses API (``POST /v1/responses``), plain and streamed, over the same scheduler as chat.

``input`` (a string, or messages whose content is a string or ``input_text`` / ``output_text`` parts) and
``instructions`` (a system message) are rendered by the model's chat template as a chat would be; the
answer is one ``message`` output item with one ``output_text`` part, preceded by a ``reasoning`` item when
the model thought (``<think>``, :mod:`tformer.serve.reasoning`). A stream is Responses' typed events:
``response.created``, ``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta`` per token, then the ``.done`` events and ``response.completed`` with the
whole response.
"""

from __future__ import annotations

import json
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from tformer.serve import reasoning
from tformer.serve import schemas as S
from tformer.serve.openai_api import chat_ids, check_model, collect, error_of, read_json
from tformer.serve.scheduler import Token


def messages_of(req: S.ResponsesRequest) -> list[dict]:
    out = [{"role": "system", "content": req.instructions}] if req.instructions else []
    if isinstance(req.input, str):
        return out + [{"role": "user", "content": req.input}]
    return out + [{"role": m.role, "content": m.text()} for m in req.input]


def response_object(id_: str, model: str, req, thought: str | None, content: str, status: str, n_in: int,
                    n_out: int) -> dict:
    """The ``response`` object: a reasoning item when the answer thought (``thought`` not None), then the
    message item (:func:`tformer.serve.reasoning.split` gives the two)."""
    output = []
    if thought is not None:
        output.append({"type": "reasoning", "id": f"rs_{id_[5:]}", "summary": [],
                       "content": [{"type": "reasoning_text", "text": thought}]})
    output.append({"type": "message", "id": f"msg_{id_[5:]}", "status": status, "role": "assistant",
                   "content": [{"type": "output_text", "text": content, "annotations": []}]})
    return {"id": id_, "object": "response", "created_at": S.now(), "status": status, "model": model,
            "output": output, "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "tools": [], "tool_choice": "auto",
            "parallel_tool_calls": False, "metadata": {}, "error": None,
            "incomplete_details": None if status == "completed" else {"reason": "max_output_tokens"},
            "usage": {"input_tokens": n_in, "output_tokens": n_out, "total_tokens": n_in + n_out,
                      "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}}


async def responses(request: Request):
    server = request.app.state.server
    req = await read_json(request, server.limits.max_body_bytes, S.ResponsesRequest)
    check_model(server, req.model)
    prompts = await chat_ids(server, messages_of(req))
    max_tokens = server.check_length(prompts, req.max_output_tokens, None)
    thinking = reasoning.opens_thinking(server.tokenizer, prompts[0])
    seqs, queue = server.start(prompts, req, max_tokens, None)
    id_, n_in = S.new_id("resp"), len(prompts[0])
    started = time.monotonic()
    if not req.stream:
        text, n_out = [""], [0]

        def on_token(i: int, tok: Token) -> None:
            text[0] += tok.text
            n_out[0] += tok.id >= 0
        try:
            reasons = await collect(request, seqs, queue, on_token)
        finally:
            for seq in seqs:
                seq.cancel()
        server.metrics.inc("tformer_requests_total", status="200", help="requests answered, by HTTP status")
        server.metrics.observe("tformer_request_seconds", time.monotonic() - started, help="request latency")
        status = "completed" if reasons[0] == "stop" else "incomplete"
        return JSONResponse(response_object(id_, server.name, req, *reasoning.split(text[0], thinking), status, n_in,
                                            n_out[0]))
    return StreamingResponse(_events(server, req, seqs, queue, id_, n_in, thinking), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


async def _events(server, req, seqs, queue, id_: str, n_in: int, thinking: bool):
    """Responses' typed SSE events for one answer (see the module docstring)."""
    seq_no = [0]

    def event(kind: str, **body) -> str:
        seq_no[0] += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq_no[0], **body})}\n\n"
    item = f"msg_{id_[5:]}"
    n_out, splitter = 0, reasoning.Splitter(thinking)
    said = {"reasoning_content": "", "content": ""}          # the answer as the splitter gave it out
    try:
        draft = response_object(id_, server.name, req, None, "", "in_progress", n_in, 0)
        draft["output"] = []
        yield event("response.created", response=draft)
        yield event("response.in_progress", response=draft)
        message = {"type": "message", "id": item, "status": "in_progress", "role": "assistant", "content": []}
        yield event("response.output_item.added", output_index=0, item=message)
        yield event("response.content_part.added", item_id=item, output_index=0, content_index=0,
                    part={"type": "output_text", "text": "", "annotations": []})
        reason = None
        while reason is None:
            _, ev = await queue.get()
            if isinstance(ev, Token):
                n_out += ev.id >= 0
                pieces = splitter.feed(ev.text)
            elif ev[0] == "done":
                reason, pieces = ev[1], splitter.flush()
            else:
                yield event("error", message=error_of(ev).message, code=None, param=None)
                return
            for field, piece in pieces:
                said[field] += piece
                if field == "content" and piece:
                    yield event("response.output_text.delta", item_id=item, output_index=0, content_index=0,
                                delta=piece, logprobs=[])
        status = "completed" if reason == "stop" else "incomplete"
        whole = response_object(id_, server.name, req, said["reasoning_content"] if splitter.thought else None,
                                said["content"], status, n_in, n_out)
        final = whole["output"][-1]
        answer = final["content"][0]["text"]
        yield event("response.output_text.done", item_id=item, output_index=0, content_index=0, text=answer,
                    logprobs=[])
        yield event("response.content_part.done", item_id=item, output_index=0, content_index=0,
                    part=final["content"][0])
        yield event("response.output_item.done", output_index=0, item=final)
        yield event("response.completed" if status == "completed" else "response.incomplete", response=whole)
        server.metrics.inc("tformer_requests_total", status="200", help="requests answered, by HTTP status")
    finally:
        for seq in seqs:
            seq.cancel()
