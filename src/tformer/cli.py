"""The ``tformer`` command. Each subcommand lives in its own module under ``tformer.commands``
with ``add_parser(subparsers)`` (which sets ``func``); this file only lists them."""

from __future__ import annotations

import argparse
import importlib
import sys

# Subcommand modules, in the order ``tformer --help`` lists them.
COMMANDS = ["train", "sample", "generate", "count", "convert", "embed", "translate"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tformer", description="Build, train, run and measure transformers.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"tformer.commands.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except ValueError as e:  # our errors name the problem and the fix: show them, not a traceback
        print(f"tformer {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
