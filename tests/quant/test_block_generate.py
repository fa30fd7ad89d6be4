"""`tformer generate --dtype q8_0 | q4_0 | q4_1`: attention and Mamba checkpoints generate, and the
note names the linears a block format left in float32 (input width not a multiple of 32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tformer.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")




@pytest.mark.parametrize("dtype", ["q8_0", "q4_0", "q4_1"])
def test_block_formats_generate_with_mamba(mamba, dtype, capsys):
    assert main(["generate", "--ckpt", str(mamba), "--prompt", "ab", "--max-new-tokens", "5", "--dtype", dtype,
                 "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    assert len(out) == 6 and "inference state: mamba" in err
    assert f"{dtype} left 2 of" in err and "dt_proj" in err, err        # dt_rank = 4 inputs stay float32


@pytest.mark.parametrize("dtype", ["q8_0", "q4_1"])
def test_block_formats_say_which_linears_stay_float32(narrow, dtype, capsys):
    """GPT-2-like with d_model 40: qkv, out and up (in 40) and the head stay float32; down (in 160) is blocks."""
    assert main(["generate", "--ckpt", str(narrow), "--prompt", "ab", "--max-new-tokens", "2", "--dtype", dtype]) == 0
    err = capsys.readouterr().err
    assert f"{dtype} left 7 of 9 linear layers in float32" in err and "multiple of 32" in err, err
