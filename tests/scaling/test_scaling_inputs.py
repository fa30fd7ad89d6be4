"""`tformer sweep` and `tformer plan` refuse numbers that cannot make a sweep or a plan, in one line
before anything is trained or measured (issue 29, items 11 and 16)."""

from __future__ import annotations

import pytest

from tformer.cli import main


def one_line(capsys, argv, *needles):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err


@pytest.mark.parametrize("argv, needle", [
    (["--tokens-per-param", "0"], "--tokens-per-param"), (["--tokens-per-param", "-5"], "--tokens-per-param"),
    (["--spread", "0"], "--spread"), (["--spread", "nan"], "--spread"), (["--spread", "1"], "--spread"),
    (["--budgets", "nan,1e9"], "finite compute budgets"), (["--budgets", "inf,1e9"], "finite compute budgets"),
    (["--context-length", "0"], "context_length=0")])
def test_sweep_refuses_impossible_numbers(tmp_path, capsys, argv, needle):
    one_line(capsys, ["sweep", "--quick", "--out", str(tmp_path / "s"), "--no-progress", *argv], needle)
    assert not (tmp_path / "s" / "runs.json").exists()


def test_plan_refuses_non_finite_numbers_and_budgets_beyond_its_configs(capsys):
    one_line(capsys, ["plan", "--flops", "1e21", "--flops-per-second", "inf"], "--flops-per-second inf")
    one_line(capsys, ["plan", "--flops", "inf", "--flops-per-second", "1e12"], "--flops inf")
    one_line(capsys, ["plan", "--params", "nan", "--flops-per-second", "1e12"], "--params nan")
    one_line(capsys, ["plan", "--flops", "1e40", "--flops-per-second", "1e12"], "beyond the largest", "smaller budget")
    assert main(["plan", "--flops", "1e21", "--flops-per-second", "1e12"]) == 0
    assert "from N" in capsys.readouterr().out


def test_convert_refuses_a_shard_size_it_would_ignore(tmp_path, capsys):
    one_line(capsys, ["convert", "--to-gguf", str(tmp_path), "--out", str(tmp_path / "m.gguf"), "--max-shard-mb", "-5"],
             "--max-shard-mb applies to --to-hf only")
    one_line(capsys, ["convert", "--to-hf", str(tmp_path), "--out", str(tmp_path / "o"), "--max-shard-mb", "-5"],
             "--max-shard-mb -5")
    one_line(capsys, ["convert", "--to-hf", str(tmp_path), "--out", str(tmp_path / "o"), "--max-shard-mb", "inf"],
             "--max-shard-mb inf")


@pytest.mark.parametrize("argv", [["--flops", "1e-300"], ["--params", "1e-9"], ["--tokens", "3"],
                                  ["--flops", "1e8", "--preset", "tiny"]])
def test_plan_refuses_budgets_below_its_smallest_config(capsys, argv):
    """Issue 49, item 23: ``--flops 1e-300`` printed a plan of 2e-136 parameters."""
    one_line(capsys, ["plan", *argv, "--flops-per-second", "1e12"], "below the smallest", "larger one")


def test_sweep_stopped_by_sigterm_exits_143(tmp_path, monkeypatch, capsys):
    """Issue 49, item 23: a sweep whose run SIGTERM stopped (the loop saves and reports ``stopped: term``)
    exits 143, as docs/reliability.md says of a stop signal; Ctrl-C's stays 130."""
    from tformer.scaling import sweep

    for name, status in (("term", 143), ("int", 130)):
        class Stopped:
            elapsed = 0.0

            @classmethod
            def create(cls, *args, **kwargs):
                return cls()

            def fit(self):
                return {"stopped": name, "history": []}

        monkeypatch.setattr(sweep, "_trainer_class", lambda bar: Stopped)
        assert main(["sweep", "--quick", "--out", str(tmp_path / name), "--no-progress"]) == status
        assert "rerun the same command" in capsys.readouterr().out
