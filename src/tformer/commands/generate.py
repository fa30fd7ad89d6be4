"""``tformer generate``: continue a prompt with a trained checkpoint, printing tokens/s to stderr."""

from __future__ import annotations

import argparse
import sys
import time

import torch


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from a checkpoint (KV-cached)",
                       description="Continue --prompt with the model in --ckpt. The text goes to stdout; "
                                   "the speed (tokens/s) to stderr.")
    p.add_argument("--ckpt", required=True, help="checkpoint folder (config.json, model.safetensors, tokenizer.json)")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=200, help="most tokens to generate (default: 200)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default: 0.8)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass in (0, 1]")
    p.add_argument("--seed", type=int, default=None, help="random seed, for reproducible sampling")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable); the text is cut before it")
    p.add_argument("--stream", action="store_true", help="print the text as it is produced")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16", "int8"],
                   help="weights: fp32, bf16, fp16, or int8 weight-only linears (default: fp32)")
    p.add_argument("--no-cache", action="store_true", help="recompute the whole window every token (slow)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tformer.checkpoint import load_model
    from tformer.inference.generate import generate_text, stream_text
    from tformer.inference.quantize import set_precision
    from tformer.training.tokenizer import load_tokenizer

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads {args.threads} must be >= 1.")
        torch.set_num_threads(args.threads)
    model = set_precision(load_model(args.ckpt).eval(), args.dtype)
    tokenizer = load_tokenizer(args.ckpt)
    stats: dict = {}
    options = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                   stop=args.stop, use_cache=not args.no_cache, stats=stats)
    start = time.perf_counter()
    if args.stream:
        for piece in stream_text(model, tokenizer, args.prompt, args.max_new_tokens, **options):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
    else:
        print(generate_text(model, tokenizer, args.prompt, args.max_new_tokens, **options))
    elapsed = time.perf_counter() - start
    n = stats.get("new_tokens", 0)
    print(f"{n} tokens in {elapsed:.2f} s: {n / max(elapsed, 1e-9):.1f} tokens/s "
          f"({args.dtype}, {'no cache' if args.no_cache else 'KV cache'}, "
          f"{torch.get_num_threads()} threads)", file=sys.stderr)
    return 0
