"""``tformer translate``: translate text with a model trained by ``tformer train --task seq2seq``."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("translate", help="translate text with a seq2seq run (beam search)",
                       description="Translate each TEXT (or each stdin line when none is given) with the model "
                                   "of a `tformer train --task seq2seq` run folder.")
    p.add_argument("text", nargs="*", help="source sentences (default: read lines from stdin)")
    p.add_argument("--ckpt", required=True, metavar="RUN", help="run folder of tformer train --task seq2seq")
    p.add_argument("--beams", type=int, default=4, help="beam size (1 = greedy; default 4)")
    p.add_argument("--length-penalty", type=float, default=1.0, help="exponent of the length in beam scores")
    p.add_argument("--max-new-tokens", type=int, default=None, help="longest output (default: 2 x source + 10)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tformer.errors import InputError
    from tformer.training.seq2seq import load_run, translate

    if args.beams < 1:
        raise InputError(f"--beams {args.beams} must be at least 1.")
    sources = args.text or [line.strip() for line in sys.stdin if line.strip()]
    if not sources:
        raise InputError("nothing to translate; pass TEXT arguments or lines on stdin.")
    model, tok, _ = load_run(args.ckpt)
    for out in translate(model, tok, sources, beams=args.beams, length_penalty=args.length_penalty,
                         max_new_tokens=args.max_new_tokens):
        print(out)
    return 0
