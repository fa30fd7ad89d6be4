"""`tformer translate` checks what a run implies before decoding (issue 29, items 5 and 16): sources
past the context, outputs past the decoder's positions, beams x length past the memory, and bad
numbers are one line with exit 2; a long source (70 words) that used to fail at position 128
translates within the context."""

from __future__ import annotations

import pytest
import torch

from tformer.cli import main
from tformer.models import build_model
from tformer.checkpoint import save_model
from tformer.training.seq2seq import TOKENIZER, Seq2SeqSettings
from tformer.training.seq2seq_data import WordTokenizer

WORDS = "red green blue one two three four five".split()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """An untrained transformer seq2seq model (context 128, the default) in a folder `translate` reads."""
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("run")
    tok = WordTokenizer.train(WORDS)
    s = Seq2SeqSettings(out_dir=str(folder), architecture={"d_model": 16, "d_ff": 32, "n_layers": 1,
                                                            "encoder_layers": 1, "dropout": 0.0})
    save_model(folder, build_model(s.model_config(tok.vocab_size)).eval())
    tok.save(folder / TOKENIZER)
    return str(folder)


def one_line(capsys, argv, *needles):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err


def test_limits_are_checked_before_decoding(run, capsys):
    one_line(capsys, ["translate", "--ckpt", run, "red", "--beams", "1000", "--max-new-tokens", "100000"],
             "--max-new-tokens 100000", "at most 127")
    one_line(capsys, ["translate", "--ckpt", run, " ".join(["red"] * 200)], "source 1 has 200 tokens", "at most 128")
    one_line(capsys, ["translate", "--ckpt", run, "red", "--beams", "100000000"], "GiB", "lower --beams")
    one_line(capsys, ["translate", "--ckpt", run, "red", "--max-new-tokens", "0"], "--max-new-tokens 0")
    one_line(capsys, ["translate", "--ckpt", run, "red", "--length-penalty", "nan"], "--length-penalty nan")


def test_a_long_source_translates_within_the_context(run, capsys):
    assert main(["translate", "--ckpt", run, " ".join(WORDS * 9)[:400], "--beams", "2"]) == 0   # 70 words
    assert len(capsys.readouterr().out.strip().splitlines()) == 1
