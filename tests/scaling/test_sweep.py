"""``tformer sweep --quick`` end to end: every run trained to its budget, fits and plots written, an
interrupted sweep continued without retraining what is done, another spec in the same folder refused."""

import json
import math
import shutil

import pytest

from tformer.cli import main
from tformer.scaling import sweep as sweep_mod
from tformer.scaling.sweep import QUICK, SweepSpec, plan_runs

pytest.importorskip("matplotlib")


def _args(tmp_path, *extra):
    corpus = tmp_path / "corpus.txt"
    if not corpus.exists():
        corpus.write_text("".join(f"{i}: the quick brown fox {i * 7 % 13} jumps over {i % 17} lazy dogs.\n"
                                  for i in range(1500)))
    return ["sweep", "--quick", "--data", str(corpus), "--out", str(tmp_path / "sweep"), "--bootstrap", "5",
            "--no-progress", "--set", f"cache_dir={tmp_path / 'cache'}", "--set", "threads=1", *extra]


def test_runs_are_planned_to_spend_each_budget():
    spec = SweepSpec(**QUICK)
    runs = plan_runs(spec, vocab_size=40)
    assert {r["budget"] for r in runs} == set(spec.budgets)
    for c in spec.budgets:
        sizes = [r["params"] for r in runs if r["budget"] == c]
        assert len(set(sizes)) == spec.sizes
    for r in runs:
        assert r["tokens"] == r["steps"] * spec.batch_size * spec.context_length
        assert r["flops"] == 6 * r["params"] * r["tokens"]
        assert abs(r["flops"] / r["budget"] - 1) <= 0.5 / r["steps"] + 1e-12      # steps rounded to the nearest


def test_quick_sweep_end_to_end_then_resume(tmp_path, capsys, monkeypatch, one_thread):
    assert main(_args(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "Besiroglu 2024" in out and "this sweep, Approach 2" in out
    folder = tmp_path / "sweep"
    record = json.loads((folder / "runs.json").read_text())
    runs = list(record["runs"].values())
    assert len(runs) == len(QUICK["budgets"]) * QUICK["sizes"]
    for r in runs:
        assert math.isfinite(r["val_loss"]) and r["val_loss"] < math.log(40)   # better than uniform guessing
        assert abs(r["flops"] / r["budget"] - 1) < 0.05
        assert (folder / "runs" / r["id"] / "metrics.jsonl").is_file()
    fits = json.loads((folder / "fits.json").read_text())
    assert fits["n_runs"] == len(runs)
    assert "approach3" in fits and math.isfinite(fits["approach3"]["a"])   # the parametric fit ran
    assert ("approach2" in fits) != ("approach2_error" in fits)            # a fit, or the stated reason why not
    for name in ("isoflop.png", "fits.png"):
        assert (folder / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Interrupt: forget two finished runs, as if the sweep had died before recording them; one also lost its
    # folder (it starts over), the other kept its final checkpoint (it resumes there). Only they run again.
    record_before = dict(record["runs"])
    gone = sorted(record["runs"])[:2]
    for key in gone:
        del record["runs"][key]
    shutil.rmtree(folder / "runs" / gone[0])
    (folder / "runs.json").write_text(json.dumps(record))
    trained = []
    real = sweep_mod._train
    monkeypatch.setattr(sweep_mod, "_train", lambda cls, spec, run, path: trained.append(run["id"]) or real(cls, spec, run, path))
    assert main(_args(tmp_path)) == 0
    assert sorted(trained) == gone
    again = json.loads((folder / "runs.json").read_text())["runs"]
    assert len(again) == len(runs)
    assert again[gone[1]]["val_loss"] == pytest.approx(record_before[gone[1]]["val_loss"], rel=1e-6)

    # Another spec in the same folder is refused with one line.
    capsys.readouterr()
    assert main(_args(tmp_path, "--sizes", "4")) == 2
    assert "other settings" in capsys.readouterr().err


@pytest.mark.parametrize("args, words", [
    (["--budgets", "1e9,lots"], "comma-separated"),
    (["--budgets", "1e9"], "at least 2"),
    (["--sizes", "2"], "at least 3 model sizes"),
    (["--set", "no_such_key=1"], "unknown setting"),
    (["--set", "lr"], "KEY=VALUE"),
])
def test_sweep_bad_input_is_one_line(tmp_path, capsys, args, words):
    assert main(["sweep", "--out", str(tmp_path / "s"), "--no-progress", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err and not (tmp_path / "s").exists()
