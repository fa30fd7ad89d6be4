"""What every route shares: the model, its tokenizer, the scheduler, limits and metrics; and the
step from a parsed request to scheduled sequences (prompt encoding, length checks, one
:class:`Sequence` per choice, events back on an asyncio queue)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

from tformer.errors import TformerError
from tformer.serve import schemas as S
from tformer.serve.metrics import Metrics
from tformer.serve.scheduler import NeverFits, Params, QueueFull, Scheduler, Sequence

PLAYGROUND = Path(__file__).parent / "playground"


@dataclass
class Limits:
    """What one request may ask for."""

    max_body_bytes: int = 512 * 1024
    max_prompts: int = 64                 # prompts in one completion request
    max_queue: int = 64
    n_slots: int = 16
    request_timeout: float = 300.0
    max_embedding_inputs: int = 256
    max_model_len: int | None = None      # positions per sequence (prompt + completion); None: the model's context
    prefix_cache_mb: float = 256.0        # KV blocks kept for shared prompt prefixes (0: none)
    speculative: int = 0                  # prompt-lookup draft tokens per step for a lone sequence (0: off)
    threads: int | None = None            # torch threads of the scheduler thread (None: torch's setting)


class Server:
    """Everything the routes share: model, tokenizer, scheduler, metrics, the optional embedder.

    Args:
        model: a DecoderLM (eval mode); its scheduler is started here.
        tokenizer: ``encode``/``decode``.
        name: the model id clients pass as ``model``.
        eos: token ids that end a sequence (``finish_reason: "stop"``).
        embedder: a zero-argument function returning ``(name, SentenceEncoder)`` on first use, or None.
        draft_model: drafts for ``limits.speculative`` instead of prompt lookup (see the Scheduler).
    """

    def __init__(self, model, tokenizer, name: str, eos=(), embedder=None, limits: Limits | None = None,
                 draft_model=None):
        self.model, self.tokenizer, self.name, self.eos = model, tokenizer, name, frozenset(eos)
        self.limits = limits or Limits()
        self.metrics = Metrics()
        self.scheduler = Scheduler(model, n_slots=self.limits.n_slots, max_len=self.limits.max_model_len,
                                   max_queue=self.limits.max_queue, metrics=self.metrics,
                                   prefix_cache_mb=self.limits.prefix_cache_mb, speculative=self.limits.speculative,
                                   threads=self.limits.threads, draft_model=draft_model)
        self.max_len = self.scheduler.max_len
        self.embedder_factory, self.embedder, self.embed_lock = embedder, None, asyncio.Lock()
        self.started = time.time()
        self.chat_separator = self._separator()
        self.chat_template = None        # a tformer.tokenizers.ChatTemplate: /v1/chat/completions renders with it
        self.defaults: dict = {}         # sampling a GGUF recommends (OpenedModel.defaults), for fields a request leaves out
        self.parse_special = False       # special-token strings in chat messages become special tokens (--parse-special)
        self.grammar = None              # a tformer.serve.grammar.GrammarEngine, made by the first response_format
        self.grammar_lock = asyncio.Lock()
        self.draining = False            # SIGTERM came: running requests finish, new ones get a 503

    def _separator(self) -> str:
        """What ends each chat message: a newline, or a space (nothing at all) when the tokenizer
        cannot encode one (a character vocabulary from a corpus without newlines)."""
        for sep in ("\n", " "):
            try:
                if self.tokenizer.encode(sep):
                    return sep
            except (TformerError, KeyError, UnicodeError):
                continue
        return ""

    def close(self) -> None:
        self.scheduler.close()

    # ------------------------------------------------------------------ request -> sequences
    def check_work(self, prompt, n: int) -> None:
        """400 before anything is encoded or allocated when ``prompt`` (a completion request's field)
        has more than ``max_prompts`` prompts, or prompts x ``n`` sequences can never be queued."""
        count = 1 if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else len(prompt)
        if count > self.limits.max_prompts:
            raise S.APIError(400, f"prompt has {count} prompts; send at most {self.limits.max_prompts} per request.",
                             param="prompt")
        if count * n > self.limits.max_queue:
            raise S.APIError(400, f"{count} prompt(s) x n={n} make {count * n} sequences; this server queues at most "
                                  f"{self.limits.max_queue} at once, so send fewer prompts or a smaller n.", param="n")

    def encode(self, text: str) -> list[int]:
        """``text``'s token ids; 400 naming the problem when the tokenizer cannot encode it."""
        try:
            return self.tokenizer.encode(text)
        except (TformerError, KeyError, UnicodeError) as e:
            why = str(e) if isinstance(e, TformerError) else f"it cannot be encoded ({e})"
            raise S.APIError(400, f"prompt: {why}", param="prompt") from None

    def encode_prompts(self, prompt) -> list[list[int]]:
        if isinstance(prompt, str):
            prompts = [self.encode(prompt)]
        elif prompt and isinstance(prompt[0], str):
            prompts = [self.encode(p) for p in prompt]
        elif prompt and isinstance(prompt[0], int):
            prompts = [list(prompt)]
        else:
            prompts = [list(p) for p in prompt]
        if not prompts:
            raise S.APIError(400, "prompt is empty; give at least one string or token.", param="prompt")
        vocab = self.model.config.vocab_size
        for p in prompts:
            if not p:
                raise S.APIError(400, "a prompt encodes to no tokens; give at least one character.", param="prompt")
            if any(not 0 <= t < vocab for t in p):
                raise S.APIError(400, f"prompt token ids must be in [0, {vocab}).", param="prompt")
        return prompts

    def check_length(self, prompts: list[list[int]], max_tokens: int | None, default: int | None) -> int:
        """``max_tokens`` to use; 400 when a prompt plus it does not fit the context (as OpenAI does)."""
        longest = max(len(p) for p in prompts)
        room = self.max_len - longest
        if room < 1:
            raise S.APIError(400, f"This model's maximum context length is {self.max_len} tokens, but the prompt "
                                  f"has {longest}; shorten the prompt.", param="prompt", code="context_length_exceeded")
        n = max_tokens if max_tokens is not None else (default if default is not None else room)
        if n > room:
            raise S.APIError(400, f"This model's maximum context length is {self.max_len} tokens; you requested "
                                  f"{longest + n} ({longest} in the prompt, {n} for the completion). Lower max_tokens "
                                  f"to at most {room}.", param="max_tokens", code="context_length_exceeded")
        return n

    def start(self, prompts: list[list[int]], req, max_tokens: int, logprobs: int | None, constraint=None,
              prompt_logprobs: int | None = None):
        """Submit ``len(prompts) * n`` sequences; return them and the queue their events arrive on.
        ``constraint``: a function giving each sequence its own structured-output constraint, or None;
        ``prompt_logprobs``: k to score the prompts' own tokens (their logprobs and top k), or None.
        A full queue is a 429 (retry after a second), a server shutting down a 503."""
        if self.draining:
            raise S.APIError(503, "The server is shutting down; send the request to another instance or retry "
                                  "once it is back.", "server_error", code="server_shutting_down")
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()

        def emitter(index: int):
            def emit(event):  # scheduler thread -> event loop; the loop may be gone if the client is
                try:
                    loop.call_soon_threadsafe(queue.put_nowait, (index, event))
                except RuntimeError:
                    pass
            return emit

        seqs, chosen = [], self.sampling(req)
        penalties = dataclasses.replace(req.penalties(), repetition=chosen["repetition_penalty"])
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t, _ in penalties.bias):
            raise S.APIError(400, f"logit_bias names a token outside [0, {vocab}); use this model's token ids.",
                             param="logit_bias")
        for p, ids in enumerate(prompts):
            for j in range(req.n):
                params = Params(max_tokens, chosen["temperature"], chosen["top_p"], chosen["top_k"],
                                None if req.seed is None else (req.seed + j) % 2**64,   # int64 seeds -> [0, 2**64)
                                req.stops(), logprobs, chosen["min_p"], prompt_logprobs, penalties)
                seqs.append(Sequence(ids, params, emitter(p * req.n + j), self.tokenizer, self.eos,
                                     timeout=self.limits.request_timeout,
                                     constraint=None if constraint is None else constraint()))
        if max_tokens == 0 and prompt_logprobs is None:
            for seq in seqs:
                seq.emit(("done", "length"))
            return seqs, queue
        try:
            self.scheduler.submit_all(seqs)
        except NeverFits as e:
            raise S.APIError(400, f"This server cannot take this request ({e}); send fewer prompts or a smaller n.",
                             param="n") from None
        except QueueFull as e:
            if self.scheduler.stopping or not self.scheduler.thread.is_alive():
                raise S.APIError(503, f"The server cannot take requests ({e}); retry later.", "server_error",
                                 code="server_shutting_down") from None
            raise S.APIError(429, f"The server is full ({e}); retry in a second.", "requests",
                             code="rate_limit_exceeded", headers={"Retry-After": "1"}) from None
        return seqs, queue

    def sampling(self, req) -> dict:
        """Temperature, top-p, top-k, min-p and the repetition penalty: as the request sets them, else as the model's file recommends
        (a GGUF's ``general.sampling.*``, :attr:`defaults`), else the request's own defaults (OpenAI's)."""
        return {k: getattr(req, k) if k in req.model_fields_set or k not in self.defaults else self.defaults[k]
                for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}

    def token_string(self, tok: int, as_ids: bool) -> str:
        return f"token_id:{tok}" if as_ids else self.tokenizer.decode([tok])


