"""The Mamba benchmarks' command line; the tasks, configurations and training run live in
:mod:`tformer.training.tasks.mamba` (re-exported here for the scripts that import them)."""

from __future__ import annotations

from tformer.training.tasks.mamba import (accuracy, attention_config, induction_heads, mamba_config,  # noqa: F401
                                          selective_copying, train)


def run_or_report(parser, run, report) -> None:
    """The experiments' command line: ``--report`` writes the table and plot from the saved runs,
    ``--model M`` trains one model and saves its run (so runs can go side by side)."""
    args = parser.parse_args()
    if args.report:
        report()
    elif args.model:
        run(args)
    else:
        parser.error("give --model or --report")
