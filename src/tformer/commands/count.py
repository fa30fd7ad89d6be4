"""``tformer count``: parameters, FLOPs and KV-cache bytes of a preset, from its config alone."""

from __future__ import annotations

import argparse

from tformer.accounting import count_parameters, state_bytes, training_flops_per_token
from tformer.config import PRESETS, TransformerConfig
from tformer.errors import InputError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("count", help="parameter / FLOP / KV-cache accounting of a preset",
                       description="Print parameters by component, training FLOPs per token and "
                                   "KV-cache bytes for a preset, without building the model.")
    p.add_argument("--preset", default="tiny", choices=list(PRESETS), help="model preset (default: tiny)")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length (default: the context length)")
    p.add_argument("--bytes", type=int, default=2, help="bytes per KV-cache element (default: 2, bf16)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    c = TransformerConfig.from_name(args.preset)
    if args.seq_len is not None and args.seq_len < 1:
        raise InputError(f"--seq-len {args.seq_len} must be >= 1.")
    if args.bytes < 1:
        raise InputError(f"--bytes {args.bytes} must be >= 1 (4 fp32, 2 bf16/fp16, 1 int8).")
    T = args.seq_len or c.context_length
    print(f"preset {args.preset}: {c.n_layers} layers, d_model {c.d_model}, {c.n_heads} heads "
          f"({c.n_kv_heads} kv), positions {c.positions}, {c.norm}/{c.norm_placement}, ffn {c.ffn}")
    print(count_parameters(c).table())
    print(f"training FLOPs per token at T={T}: {training_flops_per_token(c, T):,}")
    kind = "KV cache" if c.layer_mixers() == ["attention"] * c.n_layers else "inference state (every layer's mixer)"
    print(f"{kind} for {T} tokens ({args.bytes} bytes/element): {state_bytes(c, T, 1, args.bytes):,} bytes")
    return 0
