"""``tformer claims``: list the claims; ``tformer claims run [NAMES] [--full]`` runs them and writes the report."""

from __future__ import annotations

import argparse
import textwrap


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("claims", help="run the transformer literature's claims as experiments; HTML report",
                       description="Without arguments: list the claims. `tformer claims run [NAMES]` runs them "
                                   "(all by default) and writes a self-contained HTML report and results.json.")
    p.set_defaults(func=list_claims)
    actions = p.add_subparsers(dest="claims_action", metavar="ACTION")
    r = actions.add_parser("run", help="run claims and write the report",
                           description="Run claims (quick size unless --full), reuse cached results whose code "
                                       "and config are unchanged, and write DIR/index.html, results.json, results.md.")
    r.add_argument("names", nargs="*", metavar="NAME", help="claims to run (default: all; see `tformer claims`)")
    r.add_argument("--full", action="store_true", help="the full size (minutes per claim) instead of quick (seconds)")
    r.add_argument("--out", default="claims-report", help="report folder (default: claims-report)")
    r.add_argument("--cache-dir", default=None, help="result cache (default: ~/.cache/tformer/claims)")
    r.add_argument("--fresh", action="store_true", help="ignore cached results and measure again")
    r.add_argument("--cached-only", action="store_true",
                   help="measure nothing: assemble the report from cached results (claims run one at a time "
                        "with the same --cache-dir); a claim without one is listed as 'not run'")
    r.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    r.set_defaults(func=run)


def list_claims(args: argparse.Namespace) -> int:
    from tformer.claims import all_claims

    for c in all_claims():
        print(f"{c.name:<28} {c.title}")
        print(textwrap.indent(textwrap.fill(c.sentence, 88), " " * 29))
        print(f"{'':<29}source: {c.source}")
    return 0


def run(args: argparse.Namespace) -> int:
    import importlib.util

    import torch

    from tformer.claims import get_claims
    from tformer.claims.runner import run_claims
    from tformer.errors import InputError

    if importlib.util.find_spec("matplotlib") is None:
        raise InputError("tformer claims run draws its plots with matplotlib, which is not installed; "
                         "install it with pip install 'tformer[plot]'.")
    if args.threads is not None:
        if args.threads < 1:
            raise InputError(f"--threads {args.threads} must be at least 1.")
        torch.set_num_threads(args.threads)
    claims = get_claims(args.names)
    results = run_claims(claims, "full" if args.full else "quick", args.out, args.cache_dir, fresh=args.fresh,
                          cached_only=args.cached_only)
    width = max(len(c["name"]) for c in results["claims"])
    for c in results["claims"]:
        print(f"{c['name']:<{width}}  {c['verdict']:<15} {c['seconds']:7.1f} s{' (cached)' if c['cached'] else ''}")
    print(f"report: {args.out}/index.html")
    return 1 if any(c["verdict"] == "error" for c in results["claims"]) else 0
