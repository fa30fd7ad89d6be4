"""``tformer translate``: translate text with a model trained by ``tformer train --task seq2seq``.

Before anything is decoded the command checks what the run implies: every source must fit the
encoder's positions (``context_length`` tokens for the transformer; the RNNs have no limit), the
output length the decoder's, and the beam search's memory (``batch x beams`` rows, each holding
the decoder's keys and values, the cross-attention's and the prefix so far) what is available.
"""

from __future__ import annotations

import argparse
import math
import sys

BATCH = 64              # sources decoded together (tformer.training.seq2seq.translate's default)
MEMORY_SHARE = 0.5      # of the available memory, the most a translation may plan to use


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("translate", help="translate text with a seq2seq run (beam search)",
                       description="Translate each TEXT (or each stdin line when none is given) with the model "
                                   "of a `tformer train --task seq2seq` run folder.")
    p.add_argument("text", nargs="*", help="source sentences (default: read lines from stdin)")
    p.add_argument("--ckpt", required=True, metavar="RUN", help="run folder of tformer train --task seq2seq")
    p.add_argument("--beams", type=int, default=4, help="beam size (1 = greedy; default 4)")
    p.add_argument("--length-penalty", type=float, default=1.0, help="exponent of the length in beam scores")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="longest output (default: 2 x source + 10, within the model's context)")
    p.set_defaults(func=run)


def beam_bytes(config, rows: int, source: int, steps: int) -> int:
    """Memory a beam search over ``rows`` prefixes plans for: per row and decoder layer, keys and values
    for ``steps + 1`` target and ``source`` source positions (float32), the step's log-probabilities
    over the vocabulary (three copies: scores, sum, top-k input), and the prefix (8 bytes a token)."""
    per_row = 4 * (2 * config.n_layers * config.d_model * (steps + 1 + source) + 3 * config.vocab_size) + 16 * steps
    return rows * per_row


def run(args: argparse.Namespace) -> int:
    from tformer.errors import InputError
    from tformer.machine import available_memory
    from tformer.training.seq2seq import load_run, translate

    if args.beams < 1:
        raise InputError(f"--beams {args.beams} must be at least 1.")
    if not math.isfinite(args.length_penalty):
        raise InputError(f"--length-penalty {args.length_penalty} must be a finite number (1.0 is neutral).")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens {args.max_new_tokens} must be at least 1 (leave it out for "
                         f"2 x source + 10).")
    sources = args.text or [line.strip() for line in sys.stdin if line.strip()]
    if not sources:
        raise InputError("nothing to translate; pass TEXT arguments or lines on stdin.")
    model, tok, _ = load_run(args.ckpt)
    c = model.config
    positions = c.context_length if c.model == "encoder-decoder" else None     # the RNNs read any length
    lengths = [len(tok.encode(s)) for s in sources]
    if positions is not None:
        for i, n in enumerate(lengths):
            if n > positions:
                raise InputError(f"source {i + 1} has {n} tokens; this model reads at most {positions} "
                                 f"(its context_length): split it into shorter sentences.")
        if args.max_new_tokens is not None and args.max_new_tokens + 1 > positions:
            raise InputError(f"--max-new-tokens {args.max_new_tokens} is past this model's context: its decoder "
                             f"holds {positions} positions, so pass at most {positions - 1}.")
    budget = int(available_memory() * MEMORY_SHARE)
    out = []
    for start in range(0, len(sources), BATCH):
        chunk = sources[start:start + BATCH]
        S = max(lengths[start:start + BATCH])
        steps = args.max_new_tokens or 2 * S + 10
        if positions is not None:
            steps = min(steps, positions - 1)
        need = beam_bytes(c, len(chunk) * args.beams, S, steps)
        if need > budget:
            raise InputError(f"--beams {args.beams} with outputs of up to {steps} tokens needs about "
                             f"{need / 2**30:.3g} GiB for {len(chunk)} sources, and {budget / 2**30:.3g} GiB is "
                             f"available; lower --beams or --max-new-tokens.")
        out += translate(model, tok, chunk, beams=args.beams, length_penalty=args.length_penalty,
                         max_new_tokens=steps, batch_size=BATCH)
    for line in out:
        print(line)
    return 0
