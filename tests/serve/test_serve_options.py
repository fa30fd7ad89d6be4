"""`tformer serve`'s options (issue 29, item 12): bad values are one line and exit 2 before anything
is allocated or printed; --port 0 prints the port it got; a taken port is refused before
"serving at"; --host other than loopback warns."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

import tformer
from serve_util import tiny_checkpoint
from tformer.cli import main


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt")
    tiny_checkpoint(folder)
    return str(folder)


def one_line(capsys, argv, *needles):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "serving" not in out
    for needle in needles:
        assert needle in err, err


def test_bad_options_are_one_line(ckpt, capsys):
    one_line(capsys, ["serve", "--ckpt", ckpt, "--port", "70000"], "--port 70000", "0..65535")
    one_line(capsys, ["serve", "--ckpt", ckpt, "--port", "-1"], "--port -1")
    one_line(capsys, ["serve", "--ckpt", ckpt, "--port", "0", "--slots", "1000000000000"], "--slots", "or fewer")
    one_line(capsys, ["serve", "--ckpt", ckpt, "--port", "0", "--max-queue", "0"], "max-queue >= 1")
    one_line(capsys, ["serve", "--ckpt", ckpt, "--port", "0", "--timeout", "inf"], "timeout")
    one_line(capsys, ["serve", "--ckpt", ckpt, "--port", "0", "--embeddings", "/no-such-dir"], "/no-such-dir")


def test_a_taken_port_is_refused_before_serving(ckpt, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        one_line(capsys, ["serve", "--ckpt", ckpt, "--port", str(port)], f"port {port}", "already in use")


def test_port_zero_prints_the_real_port_and_other_hosts_warn(ckpt):
    env = {**os.environ, "PYTHONPATH": str(Path(tformer.__file__).parents[1])}
    proc = subprocess.Popen([sys.executable, "-m", "tformer.cli", "serve", "--ckpt", ckpt, "--port", "0",
                             "--host", "0.0.0.0", "--threads", "1"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        port = int(re.search(r"http://0\.0\.0\.0:(\d+)/", line).group(1))
        assert port > 0, line
        warning = proc.stderr.readline()
        while warning.startswith("tformer: building"):     # a fresh cache builds the kernels first: not the warning
            warning = proc.stderr.readline()
        assert "warning" in warning and "no API key" in warning, warning
        deadline = time.monotonic() + 60
        while True:
            try:
                assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json()["status"] == "ok"
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.2)
    finally:
        proc.terminate()
        proc.wait(timeout=20)
