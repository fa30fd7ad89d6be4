"""Continuous batching: one thread owns the model and decodes every running request together.

Each loop iteration:

1. runs queued *jobs* (anything else that needs the model, e.g. the playground's attention maps);
2. drops requests whose client went away or whose time ran out, freeing their slots;
3. admits up to ``prefill_per_step`` waiting requests into free slots of the :class:`KVPool` and
   prefills them together in one forward (so a long queue never stalls the running batch for more
   than one prefill);
4. runs ONE decode step for all running sequences: each row feeds its last token at its own
   length, gets its own logits, and picks its token with its own options and random generator
   (:func:`tformer.serve.sampling.choose`: one host transfer for the whole batch); a row whose
   sequence has a ``constraint`` (structured output, :mod:`tformer.serve.grammar`) is masked to the
   tokens its grammar allows first, at this one place where every token is picked.

A request joins the batch at the next step after its prefill and leaves the step it finishes
(stop token, stop string, ``max_tokens``, the context, timeout or disconnect); its slot is free
for the next waiting request at once. Results go back through each sequence's ``emit`` callback
(the app turns them into SSE chunks), so the scheduler knows nothing about HTTP.

**Faults.** An exception inside a step fails only the sequences that step concerns (a prefill's
admitted prompts; a decode step's running batch): each gets ``("error", message, 500)``, its slot is
freed, the traceback goes to stderr, ``tformer_step_errors_total`` counts it, and the loop goes on
with the waiting requests. Only ``BaseException``s that are not ``Exception`` (interpreter exit)
end the thread, and then every held request is told so.
"""

from __future__ import annotations

import heapq
import random
import sys
import threading
import time
import traceback
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

import torch

from tformer.generation.penalties import History, Penalties, penalize
from tformer.generation.speculative import ModelDraft, accept, lookup_draft
from tformer.generation.text import TextTracker
from tformer.serve.metrics import BATCH_BUCKETS, Metrics
from tformer.serve.pool import KVPool
from tformer.serve.sampling import choose

Tensor = torch.Tensor


class QueueFull(Exception):
    """The waiting queue is at its limit: the client should retry later (HTTP 503)."""


class NeverFits(ValueError):
    """A request holds more sequences than the queue ever takes at once: retrying cannot help (HTTP 400)."""


@dataclass
class Params:
    """One sequence's sampling options (OpenAI's names)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None          # None: none; k >= 0: the chosen token's and the top k
    min_p: float | None = None
    prompt_logprobs: int | None = None   # echo with logprobs: each prompt token's logprob and its top k (None: not wanted)
    penalties: Penalties = field(default_factory=Penalties)     # repetition, presence, frequency, logit_bias


@dataclass
class Token:
    """One generated token as the client sees it."""

    id: int
    text: str                             # new showable text (may be "" while a stop string could start)
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None


@dataclass
class Sequence:
    """A request's sequence: prompt, options, slot, output so far, and where to send results.

    ``emit(event)`` receives, when ``params.prompt_logprobs`` is set, one ``("prompt", [(token, logprob,
    top)])`` for the prompt's tokens after the first; then :class:`Token` objects, then one
    ``("done", finish_reason)`` or ``("error", message, http_status)``. Called from the scheduler thread.
    """

    prompt: list[int]
    params: Params
    emit: Callable[[object], None]
    tokenizer: object
    stop_ids: frozenset = frozenset()
    timeout: float = 600.0
    slot: int | None = None
    last: int = 0                          # the newest token (not yet in the cache)
    generated: list[int] = field(default_factory=list)
    cancelled: bool = False
    submitted: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    constraint: object | None = None       # structured output: mask(row) before each choice, advance(token) after
    penalized: bool = False                # its row of Scheduler.history is set (at its first choice, if it has penalties)

    def __post_init__(self):
        self.tracker = TextTracker(self.tokenizer, self.params.stop)
        seed = self.params.seed if self.params.seed is not None else random.getrandbits(63)
        self.generator = torch.Generator().manual_seed(seed)

    @property
    def positions(self) -> int:
        """Cache positions the sequence holds once its newest token is written (prompt + generated)."""
        return len(self.prompt) + len(self.generated)

    def cancel(self) -> None:
        """Ask the scheduler to drop this sequence (the client left); its slot is freed next step."""
        self.cancelled = True


class Scheduler:
    """Owns ``model`` on one thread; batches the decode steps of every running sequence.

    Args:
        model: a DecoderLM in eval mode.
        n_slots: sequences decoded together at most (rows of the KV pool).
        max_len: positions per slot; default the model's context.
        max_queue: waiting sequences at most; :meth:`submit` raises :class:`QueueFull` beyond.
        prefill_per_step: prompts prefilled (in one forward) between two decode steps at most.
        metrics: where counts and latencies go.
        prefix_cache_mb: MiB of KV blocks kept to reuse shared prompt prefixes (0: no prefix cache).
        speculative: draft tokens per step for a sequence decoded alone (prompt lookup,
            :mod:`tformer.generation.speculative`; 0: never speculate).
        draft_model: a cheaper model that drafts instead of prompt lookup (e.g. the same model at
            a 4-bit format, drafting for fp32); it keeps one cache, for whichever sequence speculates.
        threads: torch threads of the scheduler thread (``torch.set_num_threads`` there; None: leave
            torch's setting). ``tformer serve`` loads the model with ONE torch thread and gives the
            scheduler all of them, so that only this thread ever runs a parallel region: each OS thread
            that does gets its own OpenMP team, and once the process holds more OpenMP workers than
            cores, libgomp stops spinning between regions (its throttled spin count), which made every
            decode step about twice as slow (docs/serving.md, "One thread runs the model";
            benchmarks/results/serving/serve_threads.md).
    """

    def __init__(self, model, n_slots: int = 16, max_len: int | None = None, max_queue: int = 64,
                 prefill_per_step: int = 8, metrics: Metrics | None = None, prefix_cache_mb: float = 0,
                 speculative: int = 0, threads: int | None = None, draft_model=None):
        self.model, self.threads = model, threads
        self.max_len = max_len or model.config.context_length
        self.metrics = metrics or Metrics()
        self.pool = KVPool(model, n_slots, self.max_len, prefix_cache_mb, self.metrics)
        self.speculative = speculative
        self.draft_model, self.drafter = draft_model, None
        self.max_queue, self.prefill_per_step = max_queue, prefill_per_step
        self.free = list(range(n_slots))                    # a heap: lowest slots first keep rows contiguous
        self.history: History | None = None                 # penalties' seen / counted tokens, a row per slot (first use)
        self.running: dict[int, Sequence] = {}              # slot -> sequence
        self.waiting: deque[Sequence] = deque()
        self.jobs: deque[tuple[Callable, Future]] = deque()
        self.cond = threading.Condition()
        self.stopping = False
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, name="tformer-scheduler", daemon=True)
        self._gauges()
        self.thread.start()

    # ------------------------------------------------------------------ called from other threads
    def submit(self, seq: Sequence) -> None:
        self.submit_all([seq])

    def submit_all(self, seqs: list[Sequence]) -> None:
        """Queue every sequence of one request, or none: :class:`NeverFits` when there are more than
        ``max_queue`` (no wait makes room), :class:`QueueFull` when the queue has no room now."""
        if len(seqs) > self.max_queue:
            raise NeverFits(f"the request needs {len(seqs)} sequences (prompts x n) and the queue holds at "
                            f"most {self.max_queue}")
        with self.cond:
            if self.stopping or not self.thread.is_alive():     # nothing would ever answer: refuse, never hang
                raise QueueFull("the server is shutting down")
            if len(self.waiting) + len(seqs) > self.max_queue:
                self.metrics.inc("tformer_rejected_total", help="requests refused because the queue was full")
                raise QueueFull(f"{len(self.waiting)} of {self.max_queue} queue places are taken")
            self.waiting.extend(seqs)
            self._gauges()
            self.cond.notify()

    def run_job(self, fn: Callable[[], object]) -> Future:
        """Run ``fn()`` on the scheduler thread between two steps; its result comes in the future."""
        fut: Future = Future()
        with self.cond:
            self.jobs.append((fn, fut))
            self.cond.notify()
        return fut

    def close(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify()
        self.thread.join(timeout=10)

    # ------------------------------------------------------------------------- the thread
    def _loop(self) -> None:
        if self.threads:
            torch.set_num_threads(self.threads)          # this thread's OpenMP team (see ``threads``)
        try:
            while True:
                with self.cond:
                    while not (self.stopping or self.jobs or self.waiting or self.running):
                        self.cond.wait()
                    if self.stopping:
                        break
                try:
                    self._step()
                except Exception as e:  # a bug outside a model call: fail the running batch, keep serving
                    self._fail(list(self.running.values()), e)
        except BaseException as e:  # the interpreter is exiting: fail every request loudly rather than hang them
            self.error = e
            raise
        finally:
            with self.cond:
                left = list(self.running.values()) + list(self.waiting)
                self.running.clear()
                self.waiting.clear()
            for seq in left:
                seq.emit(("error", "the server is shutting down" if self.error is None else
                          f"internal error: {self.error!r}", 503))

    def _step(self) -> None:
        """One iteration: jobs, departures, admissions (one prefill), one decode step."""
        self._run_jobs()
        self._drop_finished_clients()
        self._admit()
        if self.running:
            try:
                self._decode()
            except Exception as e:  # the decode step concerns every running sequence
                self._fail(list(self.running.values()), e)
        self._gauges()

    def _fail(self, seqs: list[Sequence], error: Exception, status: int = 500) -> None:
        """End ``seqs`` with an error event (HTTP ``status``), free their slots, report ``error``."""
        if status >= 500:
            print(f"tformer serve: a scheduler step failed; {len(seqs)} request(s) get a 500 and serving goes on:",
                  file=sys.stderr)
            traceback.print_exception(error, file=sys.stderr)
            self.metrics.inc("tformer_step_errors_total", help="scheduler steps that raised (their requests got a 500)")
            message = f"internal error while generating ({error!r}); the server is still up, retry the request"
        else:
            message = str(error)
        for seq in seqs:
            if seq.slot is not None and self.running.get(seq.slot) is seq:
                self._finish(seq, None, "error")
            seq.emit(("error", message, status))
        self._gauges()

    def _run_jobs(self) -> None:
        while self.jobs:
            fn, fut = self.jobs.popleft()
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except Exception as e:  # reported to the caller, which turns it into a response
                    fut.set_exception(e)

    def _drop_finished_clients(self) -> None:
        now = time.monotonic()
        for slot, seq in list(self.running.items()):
            if seq.cancelled:
                self._finish(seq, None)
            elif now - seq.submitted > seq.timeout:
                self._finish(seq, "length")
        with self.cond:
            keep = deque()
            for seq in self.waiting:
                if seq.cancelled:
                    continue
                if now - seq.submitted > seq.timeout:
                    seq.emit(("error", f"the request waited {seq.timeout:g} s for a free slot; retry later"))
                    continue
                keep.append(seq)
            self.waiting = keep

    def _admit(self) -> None:
        """Move up to ``prefill_per_step`` waiting sequences into free slots and prefill them together."""
        with self.cond:
            seqs = []
            while self.free and self.waiting and len(seqs) < self.prefill_per_step:
                seq = self.waiting.popleft()
                seq.slot = heapq.heappop(self.free)
                self.running[seq.slot] = seq
                seqs.append(seq)
        if not seqs:
            return
        scored = [s for s in seqs if s.params.prompt_logprobs is not None]
        for group, score in ((scored, True), ([s for s in seqs if s.params.prompt_logprobs is None], False)):
            if group:
                self._prefill(group, score)

    def _prefill(self, seqs: list[Sequence], score: bool) -> None:
        """Prefill ``seqs`` in one batch and choose their first tokens; with ``score`` (echo with logprobs)
        each prompt's own token log-probabilities are sent first, as a ``("prompt", entries)`` event."""
        try:
            slots, prompts = [s.slot for s in seqs], [s.prompt for s in seqs]
            if score:
                logits, entries = self.pool.score(slots, prompts, max(s.params.prompt_logprobs for s in seqs))
                for seq, e in zip(seqs, entries):
                    k = seq.params.prompt_logprobs
                    seq.emit(("prompt", [(t, lp, top[:k] if k else None) for t, lp, top in e]))
            else:
                logits = self.pool.prefill(slots, prompts)                                # (b, vocab)
            self.metrics.inc("tformer_prompt_tokens_total", sum(len(s.prompt) for s in seqs),
                             help="prompt tokens prefilled")
            self.metrics.observe("tformer_prefill_batch_size", len(seqs), BATCH_BUCKETS, help="prompts in each prefill")
            done = [s for s in seqs if s.params.max_tokens == 0]                # scored only: nothing to generate
            for seq in done:
                self._finish(seq, "length")
            if len(done) < len(seqs):
                keep = [i for i, s in enumerate(seqs) if s.params.max_tokens > 0]
                self._take([seqs[i] for i in keep], logits[keep])
        except Exception as e:  # fail these requests only (a ValueError is bad input the server did not catch)
            self._fail([s for s in seqs if self.running.get(s.slot) is s], e, 400 if isinstance(e, ValueError) else 500)

    def _decode(self) -> None:
        if self.speculative and len(self.running) == 1 and self._decode_speculative(next(iter(self.running.values()))):
            return
        hi = max(self.running) + 1
        tokens = [0] * hi                                       # idle rows feed token 0 (thrown away)
        for slot, seq in self.running.items():
            tokens[slot] = seq.last
        need = max(seq.positions for seq in self.running.values())      # keys the longest row reads
        start = time.perf_counter()
        logits = self.pool.decode(torch.tensor(tokens, device=self.pool.device), need)   # (hi, vocab)
        self.metrics.observe("tformer_decode_step_seconds", time.perf_counter() - start,
                             help="time of one batched decode step")
        self.metrics.observe("tformer_batch_size", len(self.running), BATCH_BUCKETS,
                             help="sequences in each decode step")
        slots = sorted(self.running)
        self._take([self.running[s] for s in slots], logits[slots])

    def _take(self, seqs: list[Sequence], logits: Tensor) -> None:
        """Pick each sequence's next token from its row of ``logits (len(seqs), vocab)`` with its own
        options, send it, and finish the sequences that are done."""
        seqs, logits = self._constrain(seqs, self._penalize(seqs, logits))
        if not seqs:
            return
        picked = choose(logits, [s.params for s in seqs], [s.generator for s in seqs])
        counted = [i for i, s in enumerate(seqs) if s.penalized]
        if counted:                                    # every penalised row's new token, in one update
            self.history.add(torch.tensor([picked[i][0] for i in counted], device=self.history.seen.device),
                             torch.tensor([seqs[i].slot for i in counted], device=self.history.seen.device))
        self.metrics.inc("tformer_generated_tokens_total", len(seqs), help="tokens generated")
        now = time.monotonic()
        for seq, (tok, lp, top) in zip(seqs, picked):
            p = seq.params
            if seq.first_token_at is None:
                seq.first_token_at = now
                self.metrics.observe("tformer_time_to_first_token_seconds", now - seq.submitted,
                                     help="from submission to the first token")
            if tok in seq.stop_ids:
                if p.prompt_logprobs is not None:       # a scored prompt reports its next token even when it ends
                    seq.emit(Token(tok, "", lp, top))   # the text (lm-eval reads the logprobs after the prompt's)
                self._finish(seq, "stop")
                continue
            if seq.constraint is not None:
                seq.constraint.advance(tok)
            seq.generated.append(tok)
            seq.last = tok
            seq.tracker.add(tok)
            seq.emit(Token(tok, seq.tracker.take(), lp, top))   # cut before a stop string, if one appeared
            if seq.tracker.done:
                self._finish(seq, "stop")
            elif len(seq.generated) >= p.max_tokens or seq.positions >= self.max_len:
                self._finish(seq, "length")

    def _penalize(self, seqs: list[Sequence], logits: Tensor) -> Tensor:
        """``logits (len(seqs), vocab)`` with the rows whose sequence sets penalties or a logit_bias
        penalised (:mod:`tformer.generation.penalties`): one :class:`History` row per KV slot, set at the
        sequence's first choice, all such rows in one call."""
        rows = [i for i, seq in enumerate(seqs) if seq.params.penalties.active]
        if not rows:
            return logits
        if self.history is None:                                 # the first request with penalties
            self.history = History.rows(self.pool.n_slots, logits.shape[-1], logits.device)
        for i in rows:
            if not seqs[i].penalized:                            # its first choice: the prompt's tokens
                self.history.start(seqs[i].slot, seqs[i].prompt, seqs[i].params.penalties)
                seqs[i].penalized = True
        slots = torch.tensor([seqs[i].slot for i in rows], device=logits.device)
        if len(rows) == len(seqs):
            return penalize(logits, self.history, slots)
        logits = logits.float().clone()                         # the pool's output is an inference tensor
        logits[rows] = penalize(logits[rows], self.history, slots)
        return logits

    def _constrain(self, seqs: list[Sequence], logits: Tensor) -> tuple[list[Sequence], Tensor]:
        """Mask, in place, the rows of ``logits (len(seqs), vocab)`` whose sequence has a constraint
        (structured output) to the tokens its grammar allows; a sequence whose grammar fails ends with
        a 500 alone, and the others go on (returned with their rows)."""
        if all(seq.constraint is None for seq in seqs):
            return seqs, logits
        logits = logits.clone()                 # the pool's output is an inference tensor: not writable here
        failed = []
        for i, seq in enumerate(seqs):
            if seq.constraint is not None:
                try:
                    seq.constraint.mask(logits[i])
                except Exception as e:  # that request's grammar, not the batch
                    failed.append(i)
                    self._fail([seq], e)
        if not failed:
            return seqs, logits
        keep = [i for i in range(len(seqs)) if i not in failed]
        return [seqs[i] for i in keep], logits[keep]

    def _finish(self, seq: Sequence, reason: str | None, label: str = "disconnect") -> None:
        """Free ``seq``'s slot (its row's tokens go to the prefix cache unless a step failed); tell the
        client why it ended (``None``: the client is gone)."""
        self.running.pop(seq.slot, None)
        self.pool.release(seq.slot, None if label == "error" else seq.prompt + seq.generated)
        heapq.heappush(self.free, seq.slot)
        self._gauges()
        if reason is not None:
            seq.tracker.done = True
            rest = seq.tracker.take()                       # text held back for a stop string that never came
            if rest:
                seq.emit(Token(-1, rest))
            seq.emit(("done", reason))
        self.metrics.inc("tformer_sequences_total", help="sequences finished", reason=reason or label)
        self.metrics.observe("tformer_sequence_seconds", time.monotonic() - seq.submitted,
                             help="from submission to the last token")

    def _gauges(self) -> None:
        m = self.metrics
        m.set("tformer_queue_length", len(self.waiting), help="requests waiting for a slot")
        m.set("tformer_running_sequences", len(self.running), help="sequences in the decode batch")
        m.set("tformer_pool_slots_in_use", self.pool.n_slots - len(self.free), help="KV pool slots held")
        m.set("tformer_pool_slots_total", self.pool.n_slots, help="KV pool slots")
        self.pool.report(m)

    # ------------------------------------------------------------------ speculative decoding
    def _decode_speculative(self, seq: Sequence) -> bool:
        """One speculative step for ``seq`` decoded alone: draft by prompt lookup, verify the drafts in
        one forward of its row, keep the accepted ones (:mod:`tformer.generation.speculative`).
        False (nothing done: decode normally) when no draft is found or the sequence needs what a
        step over several tokens does not give: log-probabilities, a per-token logit constraint, min-p or
        penalties (the accept rule here knows temperature, top-k and top-p only)."""
        p = seq.params
        if p.logprobs is not None or seq.constraint is not None or p.min_p or p.penalties.active:
            return False
        k = min(self.speculative, p.max_tokens - len(seq.generated) - 1, self.max_len - seq.positions - 1)
        history = seq.prompt + seq.generated                   # the row holds all but the newest token
        top_p = p.top_p if p.top_p < 1 else None
        start = time.perf_counter()
        if self.draft_model is not None and k >= 1:
            draft, q = self._drafter(seq).propose(history, k, p.temperature, p.top_k, top_p, seq.generator)
        else:
            draft, q = (lookup_draft(history, k) if k >= 1 else []), None
        if not draft:
            return False
        logits = self.pool.verify(seq.slot, [seq.last] + draft)                 # (k+1, vocab)
        new = accept(logits, draft, p.temperature, p.top_k, top_p, seq.generator, q)
        self.pool.keep(seq.slot, len(history) - 1 + len(new))                  # last + the accepted drafts
        m = self.metrics
        m.observe("tformer_decode_step_seconds", time.perf_counter() - start, help="time of one batched decode step")
        m.inc("tformer_speculative_steps_total", help="speculative verification forwards")
        m.inc("tformer_speculative_drafted_tokens_total", len(draft), help="tokens drafted (prompt lookup or the draft model)")
        m.inc("tformer_speculative_accepted_tokens_total", len(new) - 1, help="drafted tokens the model accepted")
        self._take_tokens(seq, new)
        return True

    def _drafter(self, seq: Sequence) -> ModelDraft:
        """The draft model's one cache, for whichever sequence speculates (it keeps the prefix the
        next one shares: a chat's system prompt); made again only when a sequence needs more
        positions than it has."""
        need = min(self.max_len, len(seq.prompt) + seq.params.max_tokens + self.speculative + 1)
        if self.drafter is None or self.drafter.max_len < need:
            self.drafter = None                                                  # free the old one first
            self.drafter = ModelDraft(self.draft_model, need)
        return self.drafter

    def _take_tokens(self, seq: Sequence, tokens: list[int]) -> None:
        """Send ``tokens`` (already chosen) one by one as :meth:`_take` does, until ``seq`` finishes."""
        for tok in tokens:
            self.metrics.inc("tformer_generated_tokens_total", help="tokens generated")
            if tok in seq.stop_ids:
                self._finish(seq, "stop")
                return
            seq.generated.append(tok)
            seq.last = tok
            seq.tracker.add(tok)
            seq.emit(Token(tok, seq.tracker.take()))
            if seq.tracker.done:
                self._finish(seq, "stop")
                return
            if len(seq.generated) >= seq.params.max_tokens or seq.positions >= self.max_len:
                self._finish(seq, "length")
                return
