"""`tformer train --set mixer=mamba`, `tformer generate` with the recurrent state, `tformer convert`
to and from HF Mamba folders, end to end through the command line (in process: fast)."""

import json

import pytest
import torch

from tformer.cli import main

MAMBA = ["--set", "mixer=mamba", "--set", "ffn=none", "--set", "positions=none", "--set", "norm=rmsnorm",
         "--set", "bias=false", "--set", "n_layers=2", "--set", "d_model=32", "--set", "context_length=32",
         "--set", 'mixer_options={"mamba": {"d_state": 8}}', "--set", "batch_size=4", "--set", "eval_batches=2",
         "--set", "sample_tokens=16", "--set", "progress=false", "--set", "threads=1", "--set", "precision=fp32"]


def test_train_generate_and_export_a_mamba_lm(tmp_path, capsys):
    data = tmp_path / "corpus.txt"
    data.write_text("".join(f"{i}: to be, or not to be, that is the question.\n" for i in range(60)))
    run = tmp_path / "run"
    assert main(["train", "--data", str(data), "--out", str(run), *MAMBA, "--set", "max_steps=6",
                 "--set", "eval_interval=3", "--set", f"cache_dir={tmp_path / 'cache'}"]) == 0
    out = capsys.readouterr().out
    assert "step 6: train loss" in out and "generated text" in out
    from tformer.checkpoint import load_model
    assert load_model(run).config.mixer == "mamba"
    assert main(["generate", "--ckpt", str(run), "--prompt", "to be", "--max-new-tokens", "10", "--seed", "1"]) == 0
    out, err = capsys.readouterr()
    assert len(out) == 10 + 1 and "inference state: mamba" in err           # 10 characters and a newline
    assert main(["convert", "--to-hf", str(run), "--out", str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "mamba"
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "back")]) == 0
    a, b = load_model(run).eval(), load_model(tmp_path / "back").eval()
    ids = torch.randint(0, a.config.vocab_size, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(a(ids)[0], b(ids)[0], atol=1e-5, rtol=1e-5)


def test_bad_mamba_option_is_one_line(tmp_path, capsys):
    data = tmp_path / "corpus.txt"
    data.write_text("to be or not to be\n" * 20)
    rc = main(["train", "--data", str(data), "--out", str(tmp_path / "r"), *MAMBA[:-16],
               "--set", 'mixer_options={"mamba": {"d_state": 0}}', "--set", "max_steps=1"])
    err = capsys.readouterr().err
    assert rc == 2 and "d_state" in err and len(err.strip().splitlines()) == 1
