"""``tformer train --task seq2seq`` and ``tformer translate``: data, tokenizer, training, errors."""

import random

import pytest

from tformer.cli import main
from tformer.training.seq2seq_data import WordTokenizer, make_batch, number_pairs, read_pairs, split_pairs


def test_builtin_task_pairs_and_split(one_thread):
    pytest.importorskip("num2words")
    train, test = number_pairs(200, 50, seed=1, max_digits=6)
    assert len(train) == 200 and len(test) == 50 and not set(train) & set(test)
    every = dict(number_pairs(100, 0, seed=0, max_digits=2)[0])                 # all of 0..99
    assert len(every) == 100 and every["ninety-seven"] == "quatre-vingt-dix-sept" and every["zero"] == "zéro"


def test_word_tokenizer_round_trips_the_task_and_batches(one_thread):
    tok = WordTokenizer.train(["one thousand, two hundred and ninety-seven", "mille deux cent quatre-vingt-dix-sept"])
    for text in ["one thousand, two hundred and ninety-seven", "mille deux cent quatre-vingt-dix-sept"]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("zebra") == [3]                                           # unknown word
    b = make_batch([("one", "mille"), ("two hundred", "deux cent")], tok)
    assert b["src"].shape == (2, 2) and b["src_mask"].tolist() == [[1, 0], [1, 1]]
    assert b["tgt"][0].tolist()[:2] == [1, tok.stoi["mille"]] and b["targets"][0].tolist() == [tok.stoi["mille"], 2, -100]


WORDS = dict(red="rouge", green="vert", blue="bleu", black="noir", white="blanc", grey="gris")


def _pairs(n, seed=0):
    """Word-for-word colour 'translation', one to three words."""
    rng = random.Random(seed)
    return [(" ".join(s), " ".join(WORDS[w] for w in s)) for s in
            ([rng.choice(list(WORDS)) for _ in range(rng.randint(1, 3))] for _ in range(n))]


def test_train_then_translate_from_the_command_line(tmp_path, capsys, one_thread):
    pytest.importorskip("sacrebleu")
    data = tmp_path / "pairs.tsv"
    data.write_text("\n".join(f"{s}\t{t}" for s, t in _pairs(300)) + "\n")
    out = tmp_path / "run"
    args = ["train", "--task", "seq2seq", "--data", str(data), "--out", str(out), "--set", "max_steps=400",
            "--set", "d_model=32", "--set", "d_ff=64", "--set", "n_layers=1", "--set", "encoder_layers=1",
            "--set", "dropout=0", "--set", "warmup_steps=20", "--set", "progress=false", "--set", "lr=3e-3"]
    assert main(args) == 0
    assert "test: BLEU" in capsys.readouterr().out
    assert main(["translate", "--ckpt", str(out), "blue green red", "--beams", "2"]) == 0
    assert capsys.readouterr().out.strip() == "bleu vert rouge"                 # learned in 400 steps (250 sufficed for seed 1, not seed 0, after the one-loop merge)


def test_seq2seq_bad_input_is_one_line_and_exit_2(tmp_path, capsys, one_thread):
    bad = tmp_path / "bad.tsv"
    bad.write_text("no tab here\n")
    assert main(["train", "--task", "seq2seq", "--data", str(bad), "--out", str(tmp_path / "r")]) == 2
    assert "is not 'source<TAB>target'" in capsys.readouterr().err
    assert main(["train", "--task", "seq2seq", "--set", "nonsense=1"]) == 2
    assert main(["translate", "--ckpt", str(tmp_path), "hello"]) == 2
    assert "not a seq2seq run folder" in capsys.readouterr().err
    with pytest.raises(ValueError):
        read_pairs(str(tmp_path / "missing*.tsv"))
    assert len(split_pairs(_pairs(10), 0.2)[1]) == 2


def test_seq2seq_takes_model_fields_through_transformer_config():
    from tformer.errors import ConfigError
    from tformer.training.seq2seq import Seq2SeqSettings

    s = Seq2SeqSettings.from_strings({"d_model": "48", "n_kv_heads": "2", "activation": "gelu", "lr": "2e-3"})
    c = s.model_config(vocab_size=30)
    assert (c.model, c.d_model, c.n_kv_heads, c.activation, c.n_layers, c.norm_placement) == \
        ("encoder-decoder", 48, 2, "gelu", 2, "post") and s.lr == 2e-3 and c.embedding_scale
    rnn = Seq2SeqSettings.from_strings({"model": "bahdanau", "d_model": "16"}).model_config(vocab_size=30)
    assert (rnn.model, rnn.n_layers, rnn.d_model) == ("bahdanau", 1, 16)
    with pytest.raises(ConfigError, match="unknown setting 'eval_batches' for --task seq2seq"):
        Seq2SeqSettings.from_strings({"eval_batches": "5"})          # a language-model setting
    assert Seq2SeqSettings.from_strings({"eval_interval": "5"}).eval_interval == 5   # checkpoints every 5 steps
