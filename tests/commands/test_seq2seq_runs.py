"""``tformer train --task seq2seq`` runs as ``tformer train`` runs do (issue 29, items 4 and 9): the run
lock, refusing a folder that holds a run, SIGTERM saving a checkpoint, exact resume, every setting
checked before the first step, the pairs file's encoding, binary files refused.

Tiny models (1 layer a side, 16 wide) on a word-for-word colour "translation", a few steps each.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tformer.cli import main
from tformer.training.runlock import RunLock

SRC = str(Path(__file__).resolve().parents[2] / "src")
WORDS = dict(red="rouge", green="vert", blue="bleu", black="noir", white="blanc", grey="gris")
TINY = {"d_model": 16, "d_ff": 32, "n_heads": 2, "n_layers": 1, "encoder_layers": 1, "progress": "false",
        "eval_max": 8, "beams": 1, "warmup_steps": 2, "batch_size": 8, "log_interval": 1}
SMALL = [a for k, v in TINY.items() for a in ("--set", f"{k}={v}")]


def pairs_file(root: Path, n: int = 60, name: str = "pairs.tsv", encoding: str = "utf-8", extra: str = "") -> Path:
    rng = random.Random(0)
    rows = []
    for _ in range(n):
        words = [rng.choice(list(WORDS)) for _ in range(rng.randint(1, 3))]
        rows.append(" ".join(words) + "\t" + " ".join(WORDS[w] for w in words))
    path = root / name
    path.write_text(extra + "\n".join(rows) + "\n", encoding=encoding)
    return path


def one_line(rc: int, err: str, *needles: str) -> None:
    """Exit 2, exactly one line on stderr, no traceback, and the line says what it should."""
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, (rc, err)
    for needle in needles:
        assert needle in err, err


def train(tmp_path, *extra, out="run", data=None):
    data = data or pairs_file(tmp_path)
    return main(["train", "--task", "seq2seq", "--data", str(data), "--out", str(tmp_path / out), *SMALL,
                 *map(str, extra)])


# ---------------------------------------------------------------- item 4: the run folder is a run's
def test_a_second_run_on_the_same_out_is_refused_and_the_first_model_kept(tmp_path, capsys, one_thread):
    assert train(tmp_path, "--set", "max_steps=3", "--set", "eval_interval=3") == 0
    pointer = (tmp_path / "run" / "checkpoint.json").read_text()
    capsys.readouterr()
    assert train(tmp_path, "--set", "max_steps=3", "--set", "seed=5") == 2
    one_line(2, capsys.readouterr().err, "already holds a checkpoint (step 3)", "--resume")
    assert (tmp_path / "run" / "checkpoint.json").read_text() == pointer
    with RunLock(tmp_path / "busy"):                       # a live run holds the folder
        assert train(tmp_path, "--set", "max_steps=3", out="busy") == 2
    one_line(2, capsys.readouterr().err, "is in use by another", str(os.getpid()))


def test_resume_repeats_the_uninterrupted_run_exactly(tmp_path, capsys, one_thread):
    """3 steps + resume + 3 steps = 6 steps, bit for bit (dropout on: the RNG is in the checkpoint)."""
    from tformer.training.seq2seq import load_run

    both = ["--set", "precision=fp32", "--set", "dropout=0.1", "--set", "eval_interval=3"]
    assert train(tmp_path, *both, "--set", "max_steps=6", out="straight") == 0
    assert train(tmp_path, *both, "--set", "max_steps=3", out="halves") == 0
    assert main(["train", "--task", "seq2seq", "--resume", "--out", str(tmp_path / "halves"),
                 "--set", "max_steps=6", "--set", "progress=false"]) == 0
    assert "resumed" in capsys.readouterr().out
    a, b = load_run(tmp_path / "straight")[0].state_dict(), load_run(tmp_path / "halves")[0].state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert main(["train", "--task", "seq2seq", "--resume", "--out", str(tmp_path / "halves"),
                 "--set", "max_steps=8", "--set", "d_model=32"]) == 2   # another model: refused before a step
    one_line(2, capsys.readouterr().err, "architecture")


def test_sigterm_saves_a_checkpoint_and_exits_143(tmp_path):
    data = pairs_file(tmp_path)
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    args = ["train", "--task", "seq2seq", "--data", str(data), "--out", str(tmp_path / "run"), *SMALL,
            "--set", "max_steps=1000000", "--set", "eval_interval=100000"]
    proc = subprocess.Popen([sys.executable, "-m", "tformer", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        metrics = tmp_path / "run" / "metrics.jsonl"
        deadline = time.monotonic() + 90
        while not (metrics.is_file() and metrics.read_text().count("\n") >= 3) and time.monotonic() < deadline:
            time.sleep(0.05)                               # a few steps are trained, none saved yet
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM and "Traceback" not in err, err
    assert "terminated (SIGTERM)" in out and "--task seq2seq --resume" in out
    step = json.loads((tmp_path / "run" / "checkpoint.json").read_text())["step"]
    assert step >= 3
    assert main(["translate", "--ckpt", str(tmp_path / "run"), "red"]) == 0    # the saved model is usable


# ---------------------------------------------------------------- item 9: settings and input up front
@pytest.mark.parametrize("setting, needle", [
    ("max_steps=0", "max_steps=0 is out of range"), ("batch_size=0", "batch_size=0 is out of range"),
    ("lr=nan", "lr=nan is out of range"), ("test_fraction=2", "test_fraction=2.0 is out of range"),
    ("label_smoothing=5", "label_smoothing=5.0 is out of range"), ("beams=0", "beams=0 is out of range"),
    ("length_penalty=nan", "length_penalty=nan"), ("d_model=0", "d_model"),
])
def test_every_setting_is_refused_up_front_in_one_line(tmp_path, capsys, setting, needle, monkeypatch):
    import tformer.training.seq2seq as seq2seq

    monkeypatch.setattr(seq2seq, "load_data", lambda s: pytest.fail("read the data before checking the settings"))
    assert train(tmp_path, "--set", setting) == 2
    one_line(2, capsys.readouterr().err, needle)
    assert not (tmp_path / "run" / "checkpoint.json").exists()


def test_a_latin1_pairs_file_needs_and_takes_encoding(tmp_path, capsys, one_thread):
    data = pairs_file(tmp_path, encoding="latin-1", extra="café crème\tcafé crème\n")
    assert train(tmp_path, "--set", "max_steps=2", data=data) == 2
    one_line(2, capsys.readouterr().err, "is not valid utf-8", "--encoding latin-1")
    assert train(tmp_path, "--set", "max_steps=2", "--encoding", "latin-1", data=data) == 0
    from tformer.training.seq2seq import load_run
    assert "crème" in load_run(tmp_path / "run")[1].stoi             # decoded as latin-1, not replaced


def test_a_binary_pairs_file_is_refused(tmp_path, capsys):
    data = tmp_path / "model.bin"
    data.write_bytes(b"red\trouge\n" + bytes(range(256)) * 8)
    assert train(tmp_path, "--set", "max_steps=2", data=data) == 2
    one_line(2, capsys.readouterr().err, "is binary")


def test_seq2seq_under_torchrun_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert train(tmp_path, "--set", "max_steps=2") == 2
    one_line(2, capsys.readouterr().err, "trains in one process")
