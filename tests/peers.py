"""Peer implementations outside this repository that tests compare against, found where the
workspace keeps them (``../shared/peers``); a test that needs one is skipped where it is absent."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NANOGPT = next((p / "peers" / "nanoGPT" for p in (ROOT.parent / "shared", ROOT.parent.parent / "shared")
                if (p / "peers" / "nanoGPT" / "model.py").is_file()), None)
needs_nanogpt = pytest.mark.skipif(NANOGPT is None, reason="../shared/peers/nanoGPT is not here")


def nanogpt_model():
    """nanoGPT's ``model.py``, unmodified, imported from its file (as ``nanogpt_model``)."""
    spec = importlib.util.spec_from_file_location("nanogpt_model", NANOGPT / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
