"""The ASGI app (Starlette): OpenAI's API, health, metrics, and the playground.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/responses``, ``POST /v1/embeddings``,
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text), ``POST /v1/inspect`` (the
playground's attention and attribution for one token; not part of OpenAI's API), ``GET /`` and
``/static/*`` (the playground, served from this package: no CDN).

With an API key every route but ``/health`` (what a load balancer probes) needs
``Authorization: Bearer <key>``: compared in constant time (``hmac.compare_digest``, so the answer's
timing does not reveal how much of a guess was right), else a 401 in OpenAI's error shape. Without a
key, only requests whose ``Host`` is a loopback name, an IP address or a name of ``--allowed-hosts`` are
answered (:class:`HostCheck`: a DNS-rebinding page cannot drive the server), else a 400.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json

from pydantic import BaseModel, Field, StrictInt, StrictStr
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from tformer.errors import TformerError
from tformer.serve import schemas as S
from tformer.serve.inspect import explain
from tformer.serve.openai_api import chat_completions, completions, embeddings, read_json
from tformer.serve.responses_api import responses
from tformer.serve.server import PLAYGROUND, Server


async def health(request: Request):
    server: Server = request.app.state.server
    sched = server.scheduler
    alive = sched.thread.is_alive() and not server.draining       # draining: send new work elsewhere
    body = {"status": "ok" if alive else ("draining" if server.draining else "error"), "model": server.name, "running": len(sched.running),
            "waiting": len(sched.waiting), "free_slots": len(sched.free), "slots": sched.pool.n_slots}
    return JSONResponse(body, status_code=200 if alive else 503)


async def metrics(request: Request):
    return PlainTextResponse(request.app.state.server.metrics.render(), media_type="text/plain; version=0.0.4")


async def models(request: Request):
    server: Server = request.app.state.server
    data = [{"id": server.name, "object": "model", "created": int(server.started), "owned_by": "tformer"}]
    if server.embedder is not None:
        data.append({"id": server.embedder[0], "object": "model", "created": int(server.started), "owned_by": "tformer"})
    return JSONResponse({"object": "list", "data": data})


class InspectRequest(BaseModel):
    """Explain the prediction of ``token_ids[index]`` after ``prompt`` + ``token_ids[:index]``."""

    prompt: StrictStr
    token_ids: list[StrictInt] = Field(min_length=1)
    index: StrictInt = Field(ge=0)
    ablate: list[tuple[StrictInt, StrictInt]] = Field(default_factory=list, max_length=4096)   # (layer, head) pairs


async def inspect(request: Request):
    server: Server = request.app.state.server
    req = await read_json(request, server.limits.max_body_bytes, InspectRequest)
    if req.index >= len(req.token_ids):
        raise S.APIError(400, f"index {req.index} is past the {len(req.token_ids)} tokens given.", param="index")
    vocab = server.model.config.vocab_size
    if any(not 0 <= t < vocab for t in req.token_ids[:req.index + 1]):
        raise S.APIError(400, f"token_ids must be in [0, {vocab}).", param="token_ids")
    context = server.encode_prompts(req.prompt)[0] + req.token_ids[:req.index]
    target = req.token_ids[req.index]
    if len(context) > server.max_len:
        raise S.APIError(400, f"the prompt and token_ids[:index] make {len(context)} tokens; the context holds "
                              f"{server.max_len}.", param="index")
    model = server.model
    for layer, head in req.ablate:
        if not (0 <= layer < len(model.blocks) and 0 <= head < model.config.n_heads):
            raise S.APIError(400, f"ablate names head ({layer}, {head}); the model has {len(model.blocks)} layers of "
                                  f"{model.config.n_heads} heads.", param="ablate")
        if not hasattr(model.blocks[layer].attn, "forward_hooked"):
            raise S.APIError(400, f"layer {layer} is not a softmax-attention layer; only its heads can be ablated.",
                             param="ablate")
    fut = server.scheduler.run_job(lambda: explain(model, server.tokenizer, context, target, req.ablate))
    return JSONResponse(await asyncio.wrap_future(fut))


async def playground(request: Request):
    return FileResponse(PLAYGROUND / "index.html")


async def api_error(request: Request, exc: S.APIError):
    if exc.status >= 400:
        request.app.state.server.metrics.inc("tformer_requests_total", status=str(exc.status),
                                             help="requests answered, by HTTP status")
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def input_error(request: Request, exc: TformerError):
    """Bad input that library code refused in its own words: a 400, never a 500."""
    return await api_error(request, S.APIError(400, str(exc)))


async def http_error(request: Request, exc: HTTPException):
    return JSONResponse(S.APIError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)


async def server_error(request: Request, exc: Exception):
    return JSONResponse(S.APIError(500, f"internal error: {exc!r}", "server_error").body(), status_code=500)


class APIKey:
    """ASGI middleware: HTTP requests to any path but ``/health`` need ``Authorization: Bearer <key>``."""

    OPEN = ("/health",)

    def __init__(self, app, key: str, server: Server):
        self.app, self.key, self.server = app, key.encode(), server

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.OPEN:
            return await self.app(scope, receive, send)
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                given = value
        scheme, _, token = given.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
            return await self.app(scope, receive, send)
        message = ("Incorrect API key provided; pass it as the header 'Authorization: Bearer <key>' (the key given to "
                   "tformer serve --api-key or TFORMER_API_KEY)." if given else
                   "This server needs an API key; pass it as the header 'Authorization: Bearer <key>'.")
        self.server.metrics.inc("tformer_requests_total", status="401", help="requests answered, by HTTP status")
        body = json.dumps(S.APIError(401, message, code="invalid_api_key").body()).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})


def host_allowed(host: str, allowed: frozenset[str]) -> bool:
    """Whether a ``Host`` header names this server in a way no DNS-rebinding page can: a loopback name
    (``localhost``, ``*.localhost``), an IP address (a page served from an address is that address's own
    origin, so it cannot rebind), or a name in ``allowed`` (``"*"``: any)."""
    import ipaddress

    if "*" in allowed:
        return True
    name = host.strip().lower()
    if name.startswith("["):                                   # [::1]:8000
        name = name[1:].partition("]")[0]
    elif name.count(":") == 1:                                 # name:port (a bare IPv6 address has several)
        name = name.partition(":")[0]
    name = name.rstrip(".")
    if name == "localhost" or name.endswith(".localhost") or name in allowed:
        return True
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


class HostCheck:
    """ASGI middleware of a server without an API key: a request whose ``Host`` is a name other than a loopback
    one or those of ``--allowed-hosts`` is a 400. A web page whose name an attacker re-resolves to 127.0.0.1 (DNS
    rebinding) sends its own name as ``Host``, so it cannot drive the model; a client on this machine
    (``localhost``, ``127.0.0.1``) or one reaching it by address is served as before."""

    def __init__(self, app, allowed: frozenset[str], server: Server):
        self.app, self.allowed, self.server = app, allowed, server

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        host = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), None)
        if host is None or host_allowed(host, self.allowed):      # no Host at all: no browser sent it
            return await self.app(scope, receive, send)
        message = (f"The Host header {host[:100]!r} is not a name this server answers to; without an API key it answers "
                   f"only to localhost, IP addresses and the names given to tformer serve --allowed-hosts.")
        self.server.metrics.inc("tformer_requests_total", status="400", help="requests answered, by HTTP status")
        body = json.dumps(S.APIError(400, message, code="invalid_host").body()).encode()
        await send({"type": "http.response.start", "status": 400,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def build_app(server: Server, api_key: str | None = None, allowed_hosts=()) -> Starlette:
    """The app for ``server``: behind :class:`APIKey` when ``api_key``, else behind :class:`HostCheck`
    (``allowed_hosts``: names answered to beside the loopback ones and IP addresses; ``"*"``: any);
    shutting the app down stops the scheduler."""
    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        server.close()

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/models", models),
        Route("/v1/inspect", inspect, methods=["POST"]),
        Route("/health", health),
        Route("/metrics", metrics),
        Route("/", playground),
        Mount("/static", StaticFiles(directory=PLAYGROUND), name="static"),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={
        S.APIError: api_error, TformerError: input_error, HTTPException: http_error, Exception: server_error})
    app.state.server = server
    if api_key:
        app.add_middleware(APIKey, key=api_key, server=server)
    else:
        app.add_middleware(HostCheck, allowed=frozenset(h.strip().lower().rstrip(".") for h in allowed_hosts),
                           server=server)
    return app
