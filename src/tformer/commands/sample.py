"""``tformer sample``: print a prompt and its continuation from a ``tformer train`` checkpoint.

The same machinery as ``tformer generate`` (KV cache, sampling), with nanoGPT-like defaults.
"""

from __future__ import annotations

import argparse

from tformer.commands import generate


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sample", help="print a prompt and its sampled continuation from a trained checkpoint",
                       description="Continue a prompt with a model saved by `tformer train` (a run folder "
                                   "or one checkpoint folder inside it); prints the prompt and its continuation.")
    generate.add_arguments(p, prompt_default="\n", top_k_default=40)
    p.set_defaults(func=lambda args: generate.run(args, echo=True))
