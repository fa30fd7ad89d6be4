"""`tformer train` / `tformer sample` end to end, and every bad input: one clear line, exit != 0."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tformer.cli import main

SRC = str(Path(__file__).resolve().parents[2] / "src")
SMALL = ["--set", "n_layers=1", "--set", "d_model=32", "--set", "n_heads=2", "--set", "context_length=16",
         "--set", "batch_size=4", "--set", "eval_batches=2", "--set", "sample_tokens=20", "--set", "progress=false",
         "--set", "threads=1", "--set", "precision=fp32"]


def _corpus(tmp_path, name="corpus.txt", n=60):
    path = tmp_path / name
    path.write_text("".join(f"{i}: to be, or not to be, that is the question.\n" for i in range(n)))
    return str(path)


def _tformer(*args, timeout=120, **kw):
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "tformer.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout, **kw)


def _cli(capsys, *args):
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def test_train_then_sample_in_a_subprocess(tmp_path):
    data, out = _corpus(tmp_path), tmp_path / "run"
    r = _tformer("train", "--data", data, "--out", str(out), *SMALL, "--set", "max_steps=10",
                 "--set", "eval_interval=5", "--set", f"cache_dir={tmp_path / 'cache'}")
    assert r.returncode == 0, r.stderr
    assert "generated text" in r.stdout and "step 10: train loss" in r.stdout
    assert (out / "checkpoint.json").is_file() and (out / "metrics.jsonl").is_file()
    r = _tformer("sample", "--ckpt", str(out), "--prompt", "to be", "--max-new-tokens", "12", "--seed", "1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("to be") and len(r.stdout) == len("to be") + 12 + 1   # + the final newline


def test_ctrl_c_saves_a_checkpoint_and_exits_cleanly(tmp_path):
    data, out = _corpus(tmp_path), tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": SRC}
    p = subprocess.Popen([sys.executable, "-m", "tformer.cli", "train", "--data", data, "--out", str(out), *SMALL,
                          "--set", "max_steps=1000000", "--set", "eval_interval=100000", "--set", "sample_tokens=0",
                          "--set", f"cache_dir={tmp_path / 'cache'}"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    for line in p.stdout:                       # wait until the loop runs (the first evaluation is printed)
        if line.startswith("step 0:"):
            break
    time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    out_text, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert "Traceback" not in err and "interrupted at step" in out_text
    r = _tformer("sample", "--ckpt", str(out), "--prompt", "to", "--max-new-tokens", "3")
    assert r.returncode == 0, r.stderr


def test_help_is_complete(capsys):
    for args in (["--help"], ["train", "--help"], ["sample", "--help"]):
        with pytest.raises(SystemExit) as e:
            main(args)
        assert e.value.code == 0
        text = capsys.readouterr().out
        assert "usage:" in text
        if args[0] == "train":
            for word in ("--data", "--preset", "--config", "--set", "--out", "--resume", "max_steps", "n_layers"):
                assert word in text
        if args[0] == "sample":
            for word in ("--ckpt", "--prompt", "--max-new-tokens", "--temperature", "--top-k"):
                assert word in text
        if args == ["--help"]:
            assert "train" in text and "sample" in text


def _one_clear_line(rc, err, *needles):
    assert rc != 0
    assert "Traceback" not in err
    lines = [line for line in err.strip().splitlines() if line]
    assert len(lines) == 1, err
    for n in needles:
        assert n in lines[0], lines[0]


def test_bad_inputs_give_one_clear_line(tmp_path, capsys):
    cache = f"cache_dir={tmp_path / 'cache'}"
    base = [*SMALL, "--set", cache, "--set", "max_steps=2", "--set", "sample_tokens=0"]

    rc, _, err = _cli(capsys, "train", "--data", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "r0"), *base)
    _one_clear_line(rc, err, "does not exist", "--data")

    (tmp_path / "empty.txt").write_text("")
    rc, _, err = _cli(capsys, "train", "--data", str(tmp_path / "empty.txt"), "--out", str(tmp_path / "r1"), *base)
    _one_clear_line(rc, err, "empty")

    (tmp_path / "short.txt").write_text("just a few words, far too short.")
    rc, _, err = _cli(capsys, "train", "--data", str(tmp_path / "short.txt"), "--out", str(tmp_path / "r2"), *base)
    _one_clear_line(rc, err, "too short", "context_length")

    rc, _, err = _cli(capsys, "train", "--data", _corpus(tmp_path), "--out", str(tmp_path / "r3"), *base,
                      "--set", "n_layerz=3")
    _one_clear_line(rc, err, "unknown setting 'n_layerz'", "n_layers", "max_steps")

    rc, _, err = _cli(capsys, "sample", "--ckpt", str(tmp_path / "no-such-run"), "--prompt", "x")
    _one_clear_line(rc, err, "does not exist")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "tformer_config.json").write_text("{not json")
    rc, _, err = _cli(capsys, "sample", "--ckpt", str(tmp_path / "junk"), "--prompt", "x")
    _one_clear_line(rc, err, "cannot read")
    (tmp_path / "junk2").mkdir()
    rc, _, err = _cli(capsys, "sample", "--ckpt", str(tmp_path / "junk2"), "--prompt", "x")
    _one_clear_line(rc, err, "not a tformer checkpoint")

    # a finished run, then: train again into it, resume with another architecture, resume on another corpus
    data, run = _corpus(tmp_path), str(tmp_path / "run")
    rc, _, err = _cli(capsys, "train", "--data", data, "--out", run, *base)
    assert rc == 0, err
    rc, _, err = _cli(capsys, "train", "--data", data, "--out", run, *base)
    _one_clear_line(rc, err, "already holds a checkpoint", "--resume")
    rc, _, err = _cli(capsys, "train", "--resume", "--out", run, "--set", "n_layers=2")
    _one_clear_line(rc, err, "incompatible", "n_layers=1", "n_layers=2")
    other = _corpus(tmp_path, "other.txt", n=70)
    rc, _, err = _cli(capsys, "train", "--resume", "--data", other, "--out", run, "--set", "max_steps=4")
    _one_clear_line(rc, err, "differs from the one the checkpoint", "--data")
    rc, _, err = _cli(capsys, "train", "--resume", "--out", str(tmp_path / "nothing-here"))
    _one_clear_line(rc, err, "nothing to resume")

    # a checkpoint whose config no longer fits its weights
    import json
    import shutil
    shutil.copytree(run, tmp_path / "edited")
    cfg_path = next((tmp_path / "edited" / "ckpt").glob("step-*/tformer_config.json"))
    meta = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**meta, "config": {**meta["config"], "d_model": 64}}))
    rc, _, err = _cli(capsys, "sample", "--ckpt", str(tmp_path / "edited"), "--prompt", "to")
    _one_clear_line(rc, err, "does not fit its tformer_config.json")

    # and nothing was lost: the run still resumes with its own corpus
    rc, _, err = _cli(capsys, "train", "--resume", "--out", run, "--set", "max_steps=4")
    assert rc == 0, err


def test_toml_config_and_set_casting(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text('preset = "tiny"\n[model]\nn_layers = 1\nd_model = 32\nn_heads = 2\ncontext_length = 16\n'
                   '[train]\nbatch_size = 4\nmax_steps = 3\neval_batches = 1\nsample_tokens = 0\nprogress = false\n'
                   'threads = 1\n')
    rc, out, err = _cli(capsys, "train", "--config", str(cfg), "--data", _corpus(tmp_path), "--out",
                        str(tmp_path / "r"), "--set", f"cache_dir={tmp_path / 'cache'}", "--set", "lr=2e-3")
    assert rc == 0, err
    import json
    state = json.loads(next((tmp_path / "r" / "ckpt").glob("step-*/trainer.json")).read_text())
    assert state["train_config"]["lr"] == 2e-3 and state["train_config"]["max_steps"] == 3
    rc, _, err = _cli(capsys, "train", "--data", _corpus(tmp_path), "--out", str(tmp_path / "r9"),
                      "--set", "max_steps=lots")
    _one_clear_line(rc, err, "max_steps='lots'", "int")


def test_bpe_run_saves_its_tokenizer_and_samples_non_ascii(tmp_path, capsys):
    path = tmp_path / "bpe.txt"
    path.write_bytes(("Grüße aus Köln, 日本語も. " * 40).encode() + b"\xff\xfe bad bytes\n" + b"more text\n" * 40)
    run = str(tmp_path / "r")
    rc, _, err = _cli(capsys, "train", "--data", str(path), "--out", run, *SMALL, "--set", "tokenizer=bpe",
                      "--set", "bpe_vocab_size=300", "--set", "max_steps=3", "--set", f"cache_dir={tmp_path / 'c'}")
    assert rc == 0, err
    rc, out, err = _cli(capsys, "sample", "--ckpt", run, "--prompt", "Grüße 日本", "--max-new-tokens", "5")
    assert rc == 0, err
    assert out.startswith("Grüße 日本")


def test_an_encoder_or_a_seq2seq_model_is_refused_before_training(tmp_path, capsys, monkeypatch):
    """Issue 29 item 10: ``--set causal=false`` crashed at the first evaluation; it is refused in one
    sentence before the corpus is read, and so is a seq2seq family (pointing at --task seq2seq)."""
    from tformer.training import trainer

    monkeypatch.setattr(trainer, "load_corpus", lambda *a, **k: pytest.fail("read the corpus before refusing"))
    base = ["train", "--data", _corpus(tmp_path), *SMALL, "--set", "max_steps=2"]
    rc, _, err = _cli(capsys, *base, "--out", str(tmp_path / "a"), "--set", "causal=false")
    _one_clear_line(rc, err, "causal=false", "language model")
    rc, _, err = _cli(capsys, *base, "--out", str(tmp_path / "b"), "--set", "model=bahdanau")
    _one_clear_line(rc, err, "model='bahdanau'", "--task seq2seq")
    assert not (tmp_path / "a" / "checkpoint.json").exists()
