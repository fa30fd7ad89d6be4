"""``tformer kernels``: build tformer's C++ kernel libraries now, once for this machine, and say which built.

Each library is otherwise built the first time a command needs it (a minute or more on a small machine),
inside that command's start: ``make install`` runs this so that no first ``tformer chat`` and no test pays
for a build. A library that cannot be built here (no compiler, ``TFORMER_NO_EXTENSION=1``) is reported and
the commands keep torch's kernels; that is not an error.
"""

from __future__ import annotations

import argparse
import importlib
import time

# (module, its loader, what the library holds): every C++ library tformer builds
LIBRARIES = [
    ("tformer.ops.attention_cpu", "load", "attention and RoPE (training and prompts)"),
    ("tformer.ops.activation_cpu", "load", "activations (training)"),
    ("tformer.quant.gemv", "load", "float, int8 and int4 one-row products (decoding)"),
    ("tformer.quant.qgemv", "load", "GGUF block products and tiles (decoding)"),
    ("tformer.fused.library", "load", "whole decoder layers in one C++ call (prompts and decoding)"),
    ("tformer.interop.gguf_strings", "load", "a GGUF header's string arrays (opening a GGUF's vocabulary)"),
]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("kernels", help="build the C++ kernels for this machine now (make install runs it)",
                       description="Build every C++ kernel library tformer uses into its cache and report which "
                                   "built; the ones that cannot be built here leave torch's kernels in use.")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    for module_name, loader, what in LIBRARIES:
        module = importlib.import_module(module_name)
        start = time.perf_counter()
        built = getattr(module, loader)() is not None
        state = "ready" if built else module.STATUS.get("state", "unavailable")
        print(f"{module_name.removeprefix('tformer.'):<18} {state} ({time.perf_counter() - start:.1f} s): {what}", flush=True)
    return 0
