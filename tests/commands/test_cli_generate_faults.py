"""`tformer generate` and friends on inputs that used to crash (issue 29, items 1, 8, 15, 17d)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tformer
from tformer.cli import main





def test_a_denormal_temperature_generates_greedily(narrow, capsys):
    assert main(["generate", "--ckpt", str(narrow), "--prompt", "ab", "--max-new-tokens", "6",
                 "--temperature", "1e-45"]) == 0
    tiny = capsys.readouterr().out
    assert main(["generate", "--ckpt", str(narrow), "--prompt", "ab", "--max-new-tokens", "6", "--temperature", "0"]) == 0
    assert tiny == capsys.readouterr().out and len(tiny) == 7


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_int8_and_int4_generate_with_mamba(mamba, dtype, capsys):
    """Mamba's projections got a non-contiguous input; the int8/int4 kernels need packed rows."""
    assert main(["generate", "--ckpt", str(mamba), "--prompt", "ab", "--max-new-tokens", "5", "--dtype", dtype,
                 "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    assert len(out) == 6 and "inference state: mamba" in err


@pytest.mark.parametrize("dtype, width, left", [("int8", 16, 7), ("int4", 32, 7)])
def test_quantised_generate_says_which_linears_stay_bf16(narrow, dtype, width, left, capsys):
    """GPT-2-like with d_model 40: qkv, out and up (in 40) and the head stay bf16; down (in 160) is quantised."""
    assert main(["generate", "--ckpt", str(narrow), "--prompt", "ab", "--max-new-tokens", "2", "--dtype", dtype]) == 0
    err = capsys.readouterr().err
    assert f"{dtype} left {left} of 9 linear layers in bf16" in err and f"multiple of {width}" in err, err


def test_mamba_note_names_dt_proj(mamba, capsys):
    """Mamba's dt_proj reads dt_rank = 4 features: it stays bf16, and the note says so."""
    assert main(["generate", "--ckpt", str(mamba), "--prompt", "ab", "--max-new-tokens", "2", "--dtype", "int8"]) == 0
    err = capsys.readouterr().err
    assert "int8 left 2 of" in err and "dt_proj" in err, err


def run_into_a_closed_pipe(argv: list[str]) -> subprocess.CompletedProcess:
    """Run ``tformer ARGV`` with stdout a pipe whose reader has already gone (as `| head -c 0` does)."""
    read, write = os.pipe()
    os.close(read)
    env = {**os.environ, "PYTHONPATH": str(Path(tformer.__file__).parents[1])}
    try:
        return subprocess.run([sys.executable, "-m", "tformer.cli", *argv], stdout=write, stderr=subprocess.PIPE,
                              text=True, env=env, timeout=120)
    finally:
        os.close(write)


def test_a_closed_pipe_ends_quietly(narrow):
    for argv in (["claims"], ["count"], ["generate", "--ckpt", str(narrow), "--prompt", "ab", "--max-new-tokens", "30",
                                         "--stream", "--threads", "1"]):
        done = run_into_a_closed_pipe(argv)
        assert done.returncode == 141 and "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, \
            (argv, done.stderr)
