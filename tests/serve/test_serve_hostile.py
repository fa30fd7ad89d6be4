"""Issue 49, the server's side: what a hostile request or an unusual model must not do (hang the event
loop, answer from any Host, answer an unsatisfiable schema with 200, end in a traceback)."""

from __future__ import annotations

import pytest

from tformer.cli import main


def test_serving_a_seq2seq_run_is_one_sentence(tmp_path, capsys, one_thread):
    data = tmp_path / "pairs.tsv"
    data.write_text("".join(f"{a} b\t{a} c\n" for a in ("red", "green", "blue") * 10))
    run = tmp_path / "s2s"
    assert main(["train", "--task", "seq2seq", "--data", str(data), "--out", str(run), "--set", "max_steps=2",
                 "--set", "d_model=32", "--set", "d_ff=64", "--set", "n_layers=1", "--set", "encoder_layers=1",
                 "--set", "progress=false"]) == 0
    capsys.readouterr()
    assert main(["serve", "--ckpt", str(run), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "EncoderDecoder" in err and "tformer translate" in err, err
    assert main(["generate", "--ckpt", str(run), "--prompt", "hello"]) == 2
    assert "tformer translate" in capsys.readouterr().err
