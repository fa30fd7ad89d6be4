"""``tformer serve``: an OpenAI-compatible HTTP server with continuous batching, and the playground."""

from __future__ import annotations

import argparse
import errno
import ipaddress
import os
import socket
import sys
import threading
from tformer.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over OpenAI's HTTP API, with a playground at /",
                       description="Serve --model (default: the newest run under runs/) at http://HOST:PORT: "
                                   "/v1/completions, /v1/chat/completions, /v1/embeddings (MiniLM), /v1/models, "
                                   "/health, /metrics, and the playground at /.")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--model", metavar="NAME|FILE|DIR", default=None,
                       help="smollm2, a .gguf file (read as it is) or a checkpoint folder; its chat template renders "
                            "/v1/chat/completions (default: the newest run under runs/)")
    which.add_argument("--ckpt", metavar="RUN", default=None, help="a run or checkpoint folder (as --model DIR)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0: a free one, printed)")
    p.add_argument("--slots", type=int, default=16, help="sequences decoded together (default: 16)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot at most (default: 64)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a request may take (default: 300)")
    p.add_argument("--embeddings", metavar="DIR", default=None,
                   help="sentence-embedding model folder (default: all-MiniLM-L6-v2 when installed)")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16", "q8_0", "q4_0", "q4_1"],
                   help="weights (default: auto: a GGUF's own block format when all its matrices are stored in one "
                        "tformer runs, e.g. q4_1 for smollm2; fp32 otherwise); q8_0 / q4_0 / q4_1: GGUF block "
                        "formats (a GGUF stored in that format is served from its own blocks)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--verbose", action="store_true", help="say which weights and path run, and why")
    p.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="positions per sequence, prompt and completion (default: the model's context); smaller "
                        "means less memory per slot")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: env "
                        "TFORMER_API_KEY, which other users cannot read in the process list; none when unset)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGTERM or Ctrl-C, seconds running requests may take to finish before they are "
                        "ended with an error (default: 30)")
    p.add_argument("--prefix-cache-mb", type=float, default=256.0, metavar="MIB",
                   help="MiB of KV blocks kept to reuse shared prompt prefixes (default: 256; 0: off)")
    p.add_argument("--speculative", type=int, default=0, metavar="K",
                   help="draft tokens verified per step when one sequence runs alone (default: 0, off); drafted "
                        "by prompt lookup, or by --draft")
    p.add_argument("--draft", default=None, choices=["fp32", "bf16", "fp16", "q8_0", "q4_0", "q4_1"],
                   help="draft with the same model at this precision instead of prompt lookup (e.g. --dtype fp32 "
                        "--draft q4_1: fp32's tokens at about the 4-bit model's speed; needs --speculative K)")
    p.add_argument("--allowed-hosts", default="", metavar="NAMES",
                   help="without an API key the server answers only requests whose Host is localhost or an IP "
                        "address (a DNS-rebinding page cannot reach it); these comma-separated names too, e.g. "
                        "my.box,my.box.lan ('*': any name)")
    p.add_argument("--parse-special", action="store_true",
                   help="let special-token strings typed in chat messages (<|im_end|>, <|im_start|>) become the "
                        "special tokens (default: they stay text, so a message cannot forge turns or a system "
                        "message; the template's own markers are special either way)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch
    try:
        import uvicorn
    except ImportError:
        raise ConfigError("`tformer serve` needs starlette and uvicorn: pip install 'tformer[serve]'.") from None

    from tformer.serve.app import build_app
    from tformer.serve.build import build_server

    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port} is not a port; pass one in 0..65535 (0: any free port).")
    threads = max(1, args.threads) if args.threads is not None else torch.get_num_threads()
    api_key = args.api_key if args.api_key is not None else os.environ.get("TFORMER_API_KEY")
    if api_key is not None and not api_key.strip():
        raise ConfigError("the API key is empty; pass --api-key KEY (or set TFORMER_API_KEY) with a non-empty key, "
                          "or leave both out for none.")
    if not 0 <= args.shutdown_timeout < float("inf"):
        raise ConfigError(f"--shutdown-timeout {args.shutdown_timeout}: pass a finite number of seconds >= 0.")
    sock = listen(args.host, args.port)                    # before loading: a taken port fails at once
    torch.set_num_threads(1)    # loading stays on one thread; the scheduler's thread gets `threads` (see Scheduler)
    try:
        server = build_server(args.model or args.ckpt, args.slots, args.max_queue, args.timeout, args.embeddings,
                              args.dtype, args.max_model_len, prefix_cache_mb=args.prefix_cache_mb,
                              speculative=args.speculative, threads=threads, draft=args.draft,
                              parse_special=args.parse_special)
    except BaseException:
        sock.close()
        raise
    finally:
        torch.set_num_threads(threads)      # the setting as it was asked for; this thread runs no more torch work
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    if args.verbose:
        print(server.opened.describe(), file=sys.stderr, flush=True)
    print(f"serving {server.name} at http://{shown}:{port}/  (playground at /, API at /v1)", flush=True)
    if not is_loopback(args.host) and not api_key:
        print(f"tformer serve: warning: --host {args.host} accepts connections from other machines, and the server "
              f"has no API key: anyone who reaches this port can use the model. Use --host 127.0.0.1 or pass "
              f"--api-key unless you mean it (without a key it answers only to localhost, IP addresses and the names of "
              f"--allowed-hosts).", file=sys.stderr, flush=True)
    allowed = [h for h in args.allowed_hosts.split(",") if h.strip()]
    config = uvicorn.Config(build_app(server, api_key, allowed), log_level="warning",
                            timeout_graceful_shutdown=args.shutdown_timeout + 5)   # a backstop: see Draining
    Draining(config, server, args.shutdown_timeout).run(sockets=[sock])
    return 0


class Draining:
    """uvicorn's server with a graceful SIGTERM (and Ctrl-C): the first signal makes the server
    refuse new requests (503, ``/health`` says "draining") while uvicorn stops accepting connections
    and waits for the open ones; running requests finish, and those still running after ``grace``
    seconds are ended by stopping the scheduler (each gets a "shutting down" error, streams included),
    so the process exits within about ``grace`` seconds."""

    def __init__(self, config, server, grace: float):
        import uvicorn

        outer = self

        class _Server(uvicorn.Server):
            def handle_exit(self, sig, frame):
                outer.drain()
                super().handle_exit(sig, frame)

        self.uvicorn, self.server, self.grace, self.timer = _Server(config), server, grace, None

    def drain(self) -> None:
        if self.timer is None:
            self.server.draining = True
            self.timer = threading.Timer(self.grace, self.server.close)
            self.timer.daemon = True
            self.timer.start()

    def run(self, sockets) -> None:
        import signal

        # uvicorn raises the signal it caught again once it has shut down, under the handler that was
        # there before it: a quiet one makes a drained SIGTERM an exit 0 (a deliberate, clean stop)
        previous = signal.signal(signal.SIGTERM, lambda sig, frame: None)
        try:
            self.uvicorn.run(sockets=sockets)
        finally:
            signal.signal(signal.SIGTERM, previous)


def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: a free one), or one sentence saying why not."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ConfigError(f"--host {host}: {e.strerror}; pass an address of this machine such as 127.0.0.1.") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ConfigError(f"port {port} on {host} is already in use; stop what holds it or pass another --port "
                              f"(--port 0 picks a free one).") from None
        if e.errno in (errno.EACCES, errno.EPERM):
            raise ConfigError(f"port {port} on {host} needs privileges; pass a port above 1023.") from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise ConfigError(f"--host {host} is not an address of this machine; pass one it has, such as "
                              f"127.0.0.1.") from None
        raise
    sock.set_inheritable(True)
    return sock
