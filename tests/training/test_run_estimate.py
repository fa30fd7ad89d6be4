"""Before its first step a run says what a step costs and how long it will take at the least, and refuses one
that would take longer than ``max_hours`` (issue 49, item 28: ``--set context_length=100000`` on the tiny
preset started with no estimate and did not finish a step in 15 minutes)."""

from __future__ import annotations

import random

import pytest

from tformer.cli import main


@pytest.fixture
def corpus(tmp_path):
    rng = random.Random(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far"]
    path = tmp_path / "corpus.txt"
    path.write_text(" ".join(rng.choice(words) for _ in range(60_000)) + "\n")        # ~230,000 characters
    return path


def train(tmp_path, corpus, *settings):
    return main(["train", "--data", str(corpus), "--out", str(tmp_path / "run"), "--set", "progress=false",
                 "--set", "threads=1", "--set", f"cache_dir={tmp_path / 'cache'}", "--set", "sample_tokens=0",
                 *[a for s in settings for a in ("--set", s)]])


def test_a_run_of_months_is_refused_before_its_first_step(tmp_path, corpus, capsys, monkeypatch):
    from tformer.training import loop

    def first_step(self):
        raise AssertionError("the run started")
    monkeypatch.setattr(loop.Loop, "fit", first_step)
    assert train(tmp_path, corpus, "context_length=100000", "positions=rope", "val_fraction=0.5") == 2
    out, err = capsys.readouterr()
    assert "one step: " in out and "FLOPs" in out and "at least" in out, out
    err = err.strip()
    assert len(err.splitlines()) == 1 and "would take at least" in err and "max_hours=24" in err, err
    assert "--set max_hours=0" in err


def test_max_hours_0_lets_it_start(tmp_path, corpus, capsys, monkeypatch):
    from tformer.training import loop

    started = []
    monkeypatch.setattr(loop.Loop, "fit", lambda self: started.append(self.step) or {"stopped": None, "step": 0,
                                                                                      "best_val_loss": 0.0,
                                                                                      "out_dir": ""})
    train(tmp_path, corpus, "context_length=100000", "positions=rope", "val_fraction=0.5", "max_hours=0")
    assert started == [0]
    assert "one step: " in capsys.readouterr().out


def test_a_short_run_shows_its_estimate_and_trains(tmp_path, corpus, capsys):
    assert train(tmp_path, corpus, "context_length=32", "max_steps=2", "eval_interval=2", "eval_batches=1",
                 "n_layers=1") == 0
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.startswith("one step: "))
    assert "(12 x 32 tokens)" in line and "for the 2 steps to go" in line, line
