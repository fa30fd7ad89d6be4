"""``tformer plan``: the compute-optimal model for a budget, under three published scaling laws."""

from __future__ import annotations

import argparse
import json

EXAMPLES = """examples:
  tformer plan --flops 1e21                # N, D and loss under each law; a config; its time and memory here
  tformer plan --hours 24                  # a day of this machine, at the FLOP/s measured now
  tformer plan --params 1.3e9 --law hoffmann
  tformer plan --tokens 2e10 --preset gpt2-124m --json
Laws: Hoffmann et al. 2022 (E 1.69, A 406.4, B 410.7, alpha 0.34, beta 0.28), Besiroglu et al. 2024's refit of
the same data (E 1.82, A 482, B 2085, alpha 0.348, beta 0.366; the default), Kaplan et al. 2020 (N ∝ C^0.73).
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    from tformer.config import PRESETS

    p = sub.add_parser("plan", help="compute-optimal model size and tokens for a budget (Chinchilla, Kaplan)",
                       description="Split a training budget between parameters N and tokens D (C = 6ND) under "
                                   "Hoffmann's, Besiroglu's and Kaplan's scaling laws, then pick a concrete config "
                                   "near N and estimate its training time on this machine (measured) and its memory.",
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--flops", type=float, help="training budget in FLOPs")
    what.add_argument("--hours", type=float, help="training budget in hours of this machine")
    what.add_argument("--params", type=float, help="plan around this many parameters")
    what.add_argument("--tokens", type=float, help="plan around this many training tokens")
    p.add_argument("--law", default="besiroglu", choices=["besiroglu", "hoffmann", "kaplan"],
                   help="the law whose N sizes the concrete config (default besiroglu)")
    p.add_argument("--preset", default="llama-style", choices=list(PRESETS),
                   help="architecture, vocabulary and context of the config (default llama-style)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step for time and memory (default 8)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the preset's context)")
    p.add_argument("--flops-per-second", type=float, default=None,
                   help="use this training throughput instead of measuring one here")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tformer.errors import InputError
    from tformer.scaling.plan import make_plan

    if args.seq_len is not None and args.seq_len < 1:
        raise InputError(f"--seq-len {args.seq_len} must be >= 1.")
    import math

    for flag in ("flops", "hours", "params", "tokens", "flops_per_second"):
        value = getattr(args, flag)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise InputError(f"--{flag.replace('_', '-')} {value} must be a positive finite number.")
    plan = make_plan(flops=args.flops, hours=args.hours, params=args.params, tokens=args.tokens, law=args.law,
                     preset=args.preset, batch_size=args.batch_size, seq_len=args.seq_len,
                     flops_per_second=args.flops_per_second)
    print(json.dumps(plan, indent=2) if args.json else format_plan(plan))
    return 0


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.3g} {unit}"
        n /= 1000
    return ""


def format_plan(plan: dict) -> str:
    from tformer.training.trainer import duration

    g = plan["given"]
    given = next(f"{k} {v:.3g}" for k, v in g.items() if v is not None)
    lines = [f"plan for {given}" + (f" (= {plan['allocations'][0]['flops']:.3g} FLOPs at the measured "
                                    f"{plan['flops_per_second']:.3g} FLOP/s)" if g["hours"] else ""),
             f"{'law':<16}{'N (params)':>14}{'D (tokens)':>14}{'D/N':>8}{'C (FLOPs)':>12}{'loss':>8}"]
    for a in plan["allocations"]:
        loss = f"{a['loss']:.3f}" if a["loss"] is not None else "-"
        star = "*" if a["non_embedding"] else ""
        lines.append(f"{a['law']:<16}{a['n_params']:>13.3g}{star:1}{a['n_tokens']:>14.3g}{a['tokens_per_param']:>8.1f}"
                     f"{a['flops']:>12.3g}{loss:>8}")
    lines.append("  * Kaplan's N excludes embeddings; the losses are Chinchilla's (MassiveText, nats/token), "
                 "not your corpus'.")
    c, m = plan["config"], plan["memory"]
    pick = next(a for a in plan["allocations"] if a["law"] == plan["law"])
    off = 100 * (plan["config_params"] / pick["n_params"] - 1)
    lines += [f"config near N under {plan['law']} ({plan['preset']} shape): {c['n_layers']} layers, d_model {c['d_model']}, "
              f"{c['n_heads']} heads ({c['n_kv_heads']} kv), d_ff {c['d_ff']}: {plan['config_params']:,} parameters "
              f"({off:+.1f}% from N; {plan['config_params_total']:,} in all)",
              f"training: {pick['n_tokens']:.3g} tokens = {plan['steps']:,} steps of {plan['batch_size']} x {plan['seq_len']}; "
              f"{plan['train_flops']:.3g} FLOPs with attention; at {plan['flops_per_second']:.3g} FLOP/s "
              f"({'measured here on a 2-layer proxy' if plan['measured'] else 'given'}): {duration(plan['seconds'])}",
              f"memory (fp32 AdamW, batch {plan['batch_size']} x {plan['seq_len']}): parameters {_bytes(m['parameters'])}, "
              f"gradients {_bytes(m['gradients'])}, AdamW state {_bytes(m['optimizer'])}, activations "
              f"{_bytes(m['activations'])}; total {_bytes(m['training'])}",
              f"inference KV cache, one {plan['seq_len']}-token sequence in bf16: {_bytes(m['kv_cache'])}"]
    return "\n".join(lines)
