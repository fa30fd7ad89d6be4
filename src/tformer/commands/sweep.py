"""``tformer sweep``: an IsoFLOP sweep on a corpus, then Hoffmann et al.'s Approach 2 and 3 fits."""

from __future__ import annotations

import argparse

from tformer.errors import ConfigError
from tformer.exits import INTERRUPTED, stopped_exit

EXAMPLES = """examples:
  tformer sweep --quick --out runs/sweep-quick            # 3 budgets x 3 sizes of tiny models, about a minute
  tformer sweep --out runs/sweep                # 3 budgets x 5 sizes on the built-in corpus, ~30 min
                                                 # (lr 3e-3, batch 8, 100 tokens/param at the middle size)
  tformer sweep --data input.txt --budgets 1e12,1e13,1e14 --sizes 6 --tokens-per-param 20 --out runs/mine
Rerun the same command to continue an interrupted sweep.
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sweep", help="IsoFLOP sweep and scaling-law fits on your corpus and machine",
                       description="For each compute budget C (FLOPs, C = 6ND), train several model sizes for exactly "
                                   "C, then fit Approach 2 (parabola minima, N_opt ∝ C^a) and Approach 3 (L = E + "
                                   "A/N^α + B/D^β, Huber on log loss, bootstrap intervals). Writes runs.json, fits.json, "
                                   "isoflop.png and fits.png to --out; resumable.",
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", metavar="PATH", help="corpus (default: the built-in stdlib corpus)")
    p.add_argument("--out", metavar="DIR", default="runs/sweep", help="sweep folder (default: runs/sweep)")
    p.add_argument("--budgets", metavar="C1,C2,...", help="compute budgets in FLOPs (default 1e10,3e10,1e11)")
    p.add_argument("--sizes", type=int, default=None, help="model sizes per budget (default 5)")
    p.add_argument("--spread", type=float, default=None, help="largest / smallest N per budget (default 16)")
    p.add_argument("--tokens-per-param", type=float, default=None, dest="center_tokens_per_param",
                   help="D/N of the middle size of each budget (default 100: tiny CPU models train best "
                        "far above Chinchilla's 20; use 20 for models of 100 M parameters and up)")
    p.add_argument("--context-length", type=int, default=None, help="context of every run (default 64)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step (default 8)")
    p.add_argument("--set", metavar="KEY=VALUE", action="append", default=[], dest="settings",
                   help="any tformer train setting for every run, e.g. --set lr=2e-3 (repeatable)")
    p.add_argument("--bootstrap", type=int, default=200, help="bootstrap resamples for the intervals (default 200)")
    p.add_argument("--quick", action="store_true", help="a tiny sweep (3 budgets x 3 sizes) that runs in about a minute")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


# The sweep of the README (about 30 min on a busy 2-core machine). Tiny models train best far above
# Chinchilla's 20 tokens per parameter and with a larger learning rate than the trainer's default.
DEFAULT = dict(budgets=[1e10, 3e10, 1e11], center_tokens_per_param=100.0, batch_size=8,
               settings=dict(lr=3e-3, min_lr=3e-4))


def build_spec(args: argparse.Namespace):
    from tformer.scaling.sweep import QUICK, SweepSpec
    from tformer.commands.train import parse_settings
    from tformer.training.config import cast_value

    kw = dict(QUICK) if args.quick else dict(DEFAULT)
    settings = dict(kw.pop("settings", {}))
    settings.update({k: cast_value(k, v.strip()) for k, v in parse_settings(args.settings).items()})
    if args.data:
        settings["data"] = args.data
    if args.budgets:
        try:
            kw["budgets"] = [float(x) for x in args.budgets.split(",") if x.strip()]
        except ValueError:
            raise ConfigError(f"--budgets {args.budgets!r} is not a comma-separated list of numbers; "
                              f"write e.g. --budgets 1e12,3e12,1e13.") from None
    for name in ("sizes", "spread", "center_tokens_per_param", "context_length", "batch_size"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    return SweepSpec(**kw, settings=settings)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tformer.io import atomic_write_json
    from tformer.scaling.report import analyse, plot
    from tformer.scaling.sweep import load_runs, run_sweep

    if args.bootstrap < 0:
        raise ConfigError(f"--bootstrap {args.bootstrap} must be >= 0.")
    spec = build_spec(args)
    record = run_sweep(spec, args.out, progress=not args.no_progress)
    runs = sorted(record["runs"].values(), key=lambda r: (r["budget"], r["params"])) if "stopped" in record \
        else load_runs(args.out)
    if "stopped" in record or len(runs) < len(spec.budgets) * 3:
        print(f"{len(runs)} runs finished so far; rerun the same command to finish the sweep before fitting.")
        return stopped_exit(record.get("stopped")) or INTERRUPTED      # 143 for SIGTERM, as docs/ say
    analysis = analyse(runs, bootstrap=args.bootstrap)
    atomic_write_json(Path(args.out) / "fits.json", analysis)
    try:
        paths = plot(runs, analysis, args.out)
    except ConfigError as e:
        paths = []
        print(f"no plots: {e}")
    print(summary(analysis))
    print(f"wrote {Path(args.out) / 'runs.json'} ({len(record['runs'])} runs), {Path(args.out) / 'fits.json'}"
          + "".join(f", {p}" for p in paths))
    return 0


def summary(analysis: dict) -> str:
    """Our exponents and tokens per parameter beside the papers'."""
    from tformer.scaling.report import fit_rows

    lines = [f"{'':<24}{'a (N_opt ∝ C^a)':>18}{'b (D_opt ∝ C^b)':>18}{'D/N at largest C':>18}"]
    lines += [f"{name:<24}{a:>18}{b:>18}{tpp:>18}" for name, a, b, tpp in fit_rows(analysis)]
    if "approach2" in analysis:
        a2 = analysis["approach2"]
        outside = [f"{c:.3g}" for c, ok in zip(a2["budgets"], a2["bracketed"]) if not ok]
        if outside:
            lines.append(f"  warning: at C = {', '.join(outside)} the parabola's minimum lies outside the sizes trained "
                         f"(an extrapolation); widen --spread or move --tokens-per-param.")
    else:
        lines.append(f"this sweep, Approach 2: not fitted ({analysis['approach2_error']})")
    if "approach3" in analysis:
        a3 = analysis["approach3"]
        lines.append(f"  Approach 3 law: E {a3['E']:.3f}, A {a3['A']:.4g}, B {a3['B']:.4g}, "
                     f"alpha {a3['alpha']:.3f}, beta {a3['beta']:.3f}")
    else:
        lines.append(f"this sweep, Approach 3: not fitted ({analysis['approach3_error']})")
    return "\n".join(lines + ["(brackets: 90% bootstrap intervals; D/N: compute-optimal tokens per parameter)"])

