"""Ctrl-C outside a training loop (issue 49, item 13): while chat starts, while a GGUF converts, while
``generate`` loads, while ``sweep`` fits, the command ends with one line and status 130, no traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import tformer
from tformer.cli import main

SRC = str(Path(tformer.__file__).resolve().parents[1])


def interrupt(*args, **kwargs):
    raise KeyboardInterrupt


@pytest.mark.parametrize("argv, target", [
    (["chat", "--prompt", "hi"], "tformer.inference.open_model"),
    (["generate", "--model", "smollm2", "--prompt", "hi"], "tformer.inference.open_model"),
    (["convert", "--from-gguf", "x.gguf", "--out", "o"], "tformer.interop.gguf_import.convert_gguf"),
    (["sweep", "--quick", "--no-progress"], "tformer.scaling.sweep.run_sweep"),
])
def test_ctrl_c_while_starting_is_one_line_and_130(argv, target, monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(target, interrupt)
    assert main(argv) == 130
    err = capsys.readouterr().err.strip()
    assert err == f"tformer {argv[0]}: interrupted (Ctrl-C); nothing more was done.", err


def test_ctrl_c_in_sweeps_fit(monkeypatch, capsys, tmp_path):
    """Ctrl-C in the fits after the runs (Approach 3's bootstrap): 130, one line."""
    from tformer.scaling import report, sweep

    monkeypatch.setattr(sweep, "run_sweep", lambda spec, out, progress=True: {"spec": {}, "runs": {}})
    monkeypatch.setattr(sweep, "load_runs", lambda out: [{}] * 100)
    monkeypatch.setattr(report, "analyse", interrupt)
    assert main(["sweep", "--quick", "--no-progress", "--out", str(tmp_path / "s")]) == 130
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and err.endswith("interrupted (Ctrl-C); nothing more was done."), err


def test_a_real_sigint_while_a_model_loads(tmp_path):
    """SIGINT sent to a process as a terminal sends it, while ``chat`` opens its model."""
    script = textwrap.dedent("""
        import sys, time
        import tformer.inference
        from tformer.cli import main
        def slow(*a, **k):
            print("loading", flush=True)
            time.sleep(120)
        tformer.inference.open_model = slow
        sys.exit(main(["chat", "--prompt", "hi"]))
    """)
    env = {**os.environ, "PYTHONPATH": SRC}
    # a terminal's foreground process starts with SIGINT at its default; a test run launched in the background
    # (`cmd &` in a script) would hand the child an ignored SIGINT, and Python then never raises KeyboardInterrupt
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout.readline().strip() == "loading"
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert err.strip() == "tformer chat: interrupted (Ctrl-C); nothing more was done.", err
