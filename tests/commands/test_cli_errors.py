"""Bad input to the smaller commands and APIs: one clear ValueError / one-line CLI error, never a traceback."""

import pytest
import torch

from tformer import DecoderLM, TransformerConfig
from tformer.checkpoint import save_model
from tformer.cli import main
from tformer.generation.generate import generate
from tformer.quant.quantize import set_precision
from tformer.models.encoder import EncoderModel


def _one_line_error(capsys, argv, *needles):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err


def test_count_refuses_bad_numbers(capsys):
    _one_line_error(capsys, ["count", "--seq-len", "0"], "--seq-len 0 must be >= 1")
    _one_line_error(capsys, ["count", "--bytes", "-2"], "--bytes -2 must be >= 1")


def test_generate_refuses_an_encoder():
    enc = EncoderModel(TransformerConfig.from_name("bert-mini", n_layers=1, vocab_size=40))
    with pytest.raises(ValueError, match="needs a causal language model.*EncoderModel"):
        generate(enc, torch.zeros(1, 3, dtype=torch.long), 2)


def test_converted_models_are_not_saved(tmp_path):
    model = set_precision(DecoderLM(TransformerConfig(vocab_size=30, n_layers=1, d_model=32, n_heads=2)), "fp32")
    with pytest.raises(ValueError, match="save the model before converting it"):
        save_model(tmp_path, model)


def test_convert_refuses_writing_over_its_source(tmp_path, capsys):
    _one_line_error(capsys, ["convert", "--from-hf", str(tmp_path), "--out", str(tmp_path)], "is the source folder")
    _one_line_error(capsys, ["convert", "--to-hf", str(tmp_path), "--out", str(tmp_path / "x"),
                             "--max-shard-mb", "0"], "--max-shard-mb 0.0 must be > 0")


def test_embed_refuses_bad_batch_size_and_missing_file(tmp_path, capsys):
    _one_line_error(capsys, ["embed", "--batch-size", "0", "a sentence"], "--batch-size 0 must be >= 1")
    _one_line_error(capsys, ["embed", "--file", str(tmp_path / "missing.txt")], "cannot read --file")


def test_train_refuses_cuda_without_a_gpu():
    from tformer.training.config import TrainConfig
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="no CUDA GPU; use device=cpu"):
        TrainConfig(device="cuda")
