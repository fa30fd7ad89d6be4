"""Helpers for the server tests: a tiny random checkpoint and a real uvicorn server on a free loopback port."""

from __future__ import annotations

import socket
from contextlib import contextmanager
import string
import threading
import time

import torch
import uvicorn

from tformer import DecoderLM, TransformerConfig
from tformer.checkpoint import save_model
from tformer.serve.scheduler import Params, Sequence, Token
from tformer.tokenizers import CharTokenizer

CHARS = list(string.ascii_letters + string.digits + " .,:;\n()=_")


def tiny_checkpoint(folder, context: int = 64, positions: str = "learned", seed: int = 0, eos=None, **overrides):
    """Save a randomly initialised 2-layer model and a character tokenizer; return (model, tokenizer)."""
    torch.manual_seed(seed)
    tok = CharTokenizer(CHARS)
    config = TransformerConfig(vocab_size=tok.vocab_size, d_model=64, n_heads=4, n_layers=2, context_length=context,
                               positions=positions, init_std=0.1,   # varied greedy text, clear top-1 margins
                               **overrides)
    model = DecoderLM(config).eval()
    save_model(folder, model, generation={"eos_token_id": eos} if eos else None)
    tok.save(folder / "tokenizer.json")
    return model, tok


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Running:
    """A uvicorn server running ``app`` in a thread on 127.0.0.1; ``url`` is its base URL."""

    def __init__(self, app):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def run_alone(scheduler, tokenizer, prompt, max_tokens, **params) -> list[int]:
    """The token ids the scheduler streams for one request submitted alone (``params``: Params')."""
    out, done = [], threading.Event()

    def emit(event):
        if isinstance(event, Token):
            if event.id >= 0:
                out.append(event.id)
        else:
            done.set()
    scheduler.submit(Sequence(prompt, Params(max_tokens, **params), emit, tokenizer))
    assert done.wait(timeout=60)
    return out


@contextmanager
def tiny_server(folder, slots: int = 4, timeout: float = 60, **checkpoint):
    """A tiny random checkpoint in ``folder`` served on a free port: ``(model, tokenizer, server, running,
    openai client)``, stopped on exit."""
    import openai

    from tformer.serve.app import build_app
    from tformer.serve.build import build_server

    model, tok = tiny_checkpoint(folder, **checkpoint)
    server = build_server(str(folder), slots=slots)
    running = Running(build_app(server))
    client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0, timeout=timeout)
    try:
        yield model, tok, server, running, client
    finally:
        running.stop()
