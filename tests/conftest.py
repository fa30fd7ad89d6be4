"""Shared fixtures."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest on one thread, and do not stall when other processes hold the cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def claims_report(tmp_path_factory):
    """Every claim's quick run, once per session, through ``tformer claims run``: (folder, results)."""
    import json

    from tformer.cli import main

    out = tmp_path_factory.mktemp("claims-report")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["claims", "run", "--out", str(out), "--cache-dir", str(out / "cache")]) == 0
    finally:
        torch.set_num_threads(n)
    return out, json.loads((out / "results.json").read_text(encoding="utf-8"))
