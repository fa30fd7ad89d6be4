"""``tformer sample``: generate text from a checkpoint written by ``tformer train``."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sample", help="generate text from a trained checkpoint",
                       description="Continue a prompt with a model saved by `tformer train` (a run folder "
                                   "or one checkpoint folder inside it).")
    p.add_argument("--ckpt", metavar="DIR", required=True, help="run folder (--out of tformer train) or checkpoint folder")
    p.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    p.add_argument("--max-new-tokens", type=int, default=300, metavar="N", help="tokens to generate (default: 300)")
    p.add_argument("--temperature", type=float, default=0.8, metavar="T", help="0 = greedy; higher = more random (default: 0.8)")
    p.add_argument("--top-k", type=int, default=40, metavar="K", help="sample among the K likeliest tokens; 0 = all (default: 40)")
    p.add_argument("--seed", type=int, default=None, help="make the sample reproducible")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from tformer.checkpoint import load_model, resolve_checkpoint
    from tformer.inference.generate import generate
    from tformer.training.tokenizer import load_tokenizer

    if args.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens} must be >= 0.")
    folder = resolve_checkpoint(args.ckpt)
    model = load_model(folder)
    tok = load_tokenizer(folder)
    if tok.vocab_size != model.config.vocab_size:
        raise ValueError(f"{folder}: the tokenizer has {tok.vocab_size} tokens but the model {model.config.vocab_size}; "
                         f"the checkpoint is inconsistent; use another checkpoint.")
    ids = tok.encode(args.prompt)
    if not ids:
        raise ValueError("the prompt encodes to no tokens; pass a non-empty --prompt.")
    out = generate(model, torch.tensor([ids]), args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k or None, seed=args.seed)
    sys.stdout.write(tok.decode(out[0].tolist()) + "\n")
    return 0
