"""What a first start after `make install` finds: a fresh tformer cache holding only the built kernels (no
model converted from a file, no kernel choice measured), and Python's bytecode cached in a folder of its own."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def first_start_env(prefix: str, bytecode: bool = True) -> tuple[dict, Path]:
    """``(environment, cache)``: ``TFORMER_CACHE`` a fresh folder linking the built kernel libraries of the
    current cache (the ``gguf`` folder of converted models left out); with ``bytecode``, Python writes and
    reuses bytecode under it (``PYTHONDONTWRITEBYTECODE`` dropped), as an installed tformer runs."""
    from tformer.interop.builtin import cache_root

    cache = Path(tempfile.mkdtemp(prefix=prefix))
    for kernel in cache_root().glob("*-*"):
        if kernel.is_dir() and not kernel.name.startswith("gguf"):
            (cache / kernel.name).symlink_to(kernel.resolve())
    env = {**os.environ, "TFORMER_CACHE": str(cache)}
    if bytecode:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(cache / "bytecode")
    return env, cache
