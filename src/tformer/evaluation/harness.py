"""lm-evaluation-harness's model interface for any model :func:`tformer.inference.open_model` opens.

lm-eval asks three things of a model (``lm_eval.api.model.LM``), each for a list of requests:

- ``loglikelihood(context, continuation)``: ``sum_t log p(c_t | context, c_<t)`` over the continuation's
  tokens, and whether greedy decoding would produce exactly them (multiple-choice tasks compare the
  choices' sums);
- ``loglikelihood_rolling(text)``: the whole text's log-likelihood in windows of the model's context,
  each token predicted from as much context as fits (perplexity);
- ``generate_until(context, until, max_gen_toks)``: greedy text up to a stop string.

Tokenization is lm-eval's own (``TemplateLM._encode_pair``: the context and the whole string encoded, the
continuation is the difference), with the model's tokenizer, so the token ids equal those its ``hf``
backend and its ``local-completions`` client send. Scoring runs ``B`` requests per forward, right-padded
(a causal model's token ``t`` reads only ``j <= t``, so padding after a row changes nothing in it),
sorted longest first so rows in a batch have similar lengths; one forward gives every position's logits,
and the continuation's log-probabilities are read at the positions before its tokens.
"""

from __future__ import annotations

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from tformer.inference import special_token_id

# Logits one scoring forward keeps (float32): the batch is cut to stay under it.
BATCH_FLOATS = 2**25


class TformerLM(TemplateLM):
    """lm-eval's model for an :class:`tformer.inference.OpenedModel` (``opened``).

    Args:
        opened: what :func:`tformer.inference.open_model` returned (a decoder with a tokenizer).
        batch_size: requests per forward at most (fewer when their logits would pass :data:`BATCH_FLOATS`).
        max_gen_toks: ``generate_until``'s default limit when a task names none.
    """

    def __init__(self, opened, batch_size: int = 16, max_gen_toks: int = 256):
        super().__init__()
        self.opened, self.model, self.tok = opened, opened.model, opened.tokenizer
        self.batch_size, self.max_gen_toks = batch_size, max_gen_toks
        self.max_length = self.model.config.context_length
        self.vocab = self.model.config.vocab_size
        self.stop_ids = list(opened.stop_ids)

    # ------------------------------------------------------------------ what TemplateLM needs
    @property
    def eot_token_id(self) -> int:
        """The end-of-text id: the template's ``eos_token`` (as transformers' tokenizer names it), else the
        first stop id."""
        eos = special_token_id(self.opened.template, self.tok, "eos_token")
        return eos if eos is not None else (self.stop_ids[0] if self.stop_ids else 0)

    @property
    def prefix_token_id(self) -> int:
        """What an empty context (and a rolling window's first token) is conditioned on: the ``bos_token``
        when there is one, else the end-of-text id (the hf backend's rule)."""
        bos = special_token_id(self.opened.template, self.tok, "bos_token")
        return bos if bos is not None else self.eot_token_id

    @property
    def tokenizer_name(self) -> str:
        return self.opened.name

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tok.encode(string)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """``requests``: ``[(key, context ids, continuation ids)]`` -> ``[(sum of logprobs, is greedy)]``."""
        return self.score([((context + continuation)[-(self.max_length + 1):], len(continuation))
                           for _, context, continuation in requests])

    @torch.inference_mode()
    def score(self, rows: list[tuple[list[int], int]]) -> list[tuple[float, bool]]:
        """For each ``(tokens, n)``: ``sum log p(tokens[t] | tokens[:t])`` over the last ``n`` tokens, and
        whether each of them is the argmax there. The model reads ``tokens[:-1]`` (``(b, T)`` right-padded),
        position ``t`` predicting ``tokens[t + 1]``."""
        out: list[tuple[float, bool] | None] = [None] * len(rows)
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))     # longest first
        start = 0
        while start < len(order):
            T = len(rows[order[start]][0]) - 1
            b = max(1, min(self.batch_size, BATCH_FLOATS // max(1, T * self.vocab)))
            batch = order[start:start + b]
            start += len(batch)
            ids = torch.zeros(len(batch), T, dtype=torch.long)
            for r, i in enumerate(batch):
                tokens = rows[i][0][:-1]
                ids[r, :len(tokens)] = torch.tensor(tokens)
            logits, _ = self.model(ids)                                            # (b, T, vocab)
            for r, i in enumerate(batch):
                tokens, n = rows[i]
                at = torch.arange(len(tokens) - 1 - n, len(tokens) - 1)           # positions before the n tokens
                logp = torch.log_softmax(logits[r, at].double(), dim=-1)          # (n, vocab)
                target = torch.tensor(tokens[-n:])
                total = float(logp.gather(1, target[:, None]).sum())
                out[i] = (total, bool((logp.argmax(dim=-1) == target).all()))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood over windows of the context (lm-eval's rolling windows: every token
        predicted once, from as many earlier tokens as fit), the first predicted from the end-of-text token."""
        rows, owner = [], []
        for k, req in enumerate(requests):
            windows = get_rolling_token_windows(self.tok_encode(req.args[0]), self.prefix_token_id,
                                                self.max_length, context_len=1)
            for context, continuation in map(make_disjoint_window, windows):
                rows.append(((context + continuation)[-(self.max_length + 1):], len(continuation)))
                owner.append(k)
        totals = [0.0] * len(requests)
        for k, (ll, _) in zip(owner, self.score(rows)):
            totals[k] += ll
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, cut before the first of the task's ``until`` strings (or at an end-of-turn
        token), at most ``max_gen_toks`` tokens; requests with the same options are generated as one batch."""
        from tformer.generation.text import generate_text

        out: list[str | None] = [None] * len(requests)
        groups: dict[tuple, list[int]] = {}
        for i, req in enumerate(requests):
            kw = dict(req.args[1])
            until = kw.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            groups.setdefault((tuple(until), int(kw.get("max_gen_toks", self.max_gen_toks))), []).append(i)
        for (until, most), members in groups.items():
            for s in range(0, len(members), self.batch_size):
                part = members[s:s + self.batch_size]
                prompts = [requests[i].args[0] for i in part]
                texts = generate_text(self.model, self.tok, prompts, most, stop=list(until),
                                      stop_tokens=self.stop_ids or None, temperature=0)
                for i, text in zip(part, texts):
                    out[i] = text
        return out
