"""``tformer train --nproc N`` checks the run before torchrun starts (issue 29, item 13), and the
torchrun wrapper turns a failed job into its first failing rank's exit status, not a traceback.

Fast, in this process: starting torchrun is replaced by a failure, so a check that comes too late fails
the test. The real jobs (signals, failing ranks) are in test_distributed.py.
"""

import signal

import pytest

from tformer.cli import main
from tformer.training import launcher


@pytest.fixture
def no_torchrun(monkeypatch):
    monkeypatch.setattr(launcher.subprocess, "Popen", lambda *a, **k: pytest.fail("torchrun started"))
    monkeypatch.setattr(launcher, "available_cores", lambda: 2)             # the 2-core machine


def _one_line(capsys, *needles):
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err


def test_a_batch_that_does_not_split_over_the_ranks_is_one_line_before_torchrun(no_torchrun, tmp_path, capsys):
    assert main(["train", "--nproc", "2", "--set", "batch_size=3", "--out", str(tmp_path / "r")]) == 2
    _one_line(capsys, "batch_size x grad_accum = 3", "multiple of 2")


def test_more_ranks_than_cores_is_one_line_before_torchrun(no_torchrun, tmp_path, capsys):
    assert main(["train", "--nproc", "64", "--out", str(tmp_path / "r")]) == 2
    _one_line(capsys, "--nproc 64", "2 CPU core(s)", "--nproc 2 or fewer")


@pytest.mark.parametrize("args, needle", [
    (["--set", "lr=nan"], "lr=nan"), (["--set", "n_layerz=2"], "unknown setting 'n_layerz'"),
    (["--set", "causal=false"], "causal=false"), (["--nproc", "0"], "--nproc 0 must be at least 1"),
    (["--data", "/no/such/corpus.txt"], "corpus path /no/such/corpus.txt does not exist"),
])
def test_other_settings_are_refused_once_before_torchrun(no_torchrun, tmp_path, capsys, args, needle):
    assert main(["train", "--nproc", "2", "--out", str(tmp_path / "r"), *args]) == 2
    _one_line(capsys, needle)


def test_a_resume_is_checked_against_the_saved_batch(no_torchrun, tmp_path, capsys):
    """On --resume the batch comes from the checkpoint: 3 rows saved, 2 ranks asked for."""
    import json

    run = tmp_path / "run"
    (run / "ckpt" / "step-0000002").mkdir(parents=True)
    (run / "checkpoint.json").write_text(json.dumps({"latest": "ckpt/step-0000002", "step": 2}))
    (run / "ckpt" / "step-0000002" / "trainer.json").write_text(json.dumps({"train_config": {"batch_size": 3}}))
    assert main(["train", "--nproc", "2", "--resume", "--out", str(run)]) == 2
    _one_line(capsys, "= 3 sequences", "multiple of 2")


def test_the_wrapper_returns_the_first_failing_rank_status(monkeypatch, capsys):
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    def failing(code):
        def run(args):
            raise ChildFailedError("tformer", {1: ProcessFailure(local_rank=1, pid=1, exitcode=code, error_file="-")})
        return run

    args = ["--standalone", "--nproc-per-node=2", "-m", "tformer", "train"]
    for code, want, printed in ((2, 2, False), (1, 1, True), (-signal.SIGTERM, 143, False), (143, 143, False)):
        monkeypatch.setattr(torchrun, "run", failing(code))
        assert launcher.main(args) == want
        err = capsys.readouterr().err
        assert ("rank 1 failed with exit status 1" in err) == printed and "Traceback" not in err

    def signalled(args):
        raise SignalException("got SIGTERM", sigval=signal.SIGTERM)
    monkeypatch.setattr(torchrun, "run", signalled)
    assert launcher.main(args) == 128 + signal.SIGTERM


def test_the_rank_that_failed_by_itself_is_reported_not_the_one_torchrun_stopped():
    """Rank 0 exits 2 (a one-line error); torchrun then stops rank 1 (-15): the job's status is rank 0's."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    stopped = ProcessFailure(local_rank=0, pid=1, exitcode=-signal.SIGTERM, error_file="-")
    failed = ProcessFailure(local_rank=1, pid=2, exitcode=2, error_file="-")
    stopped.timestamp = failed.timestamp = 100                                  # the same second
    assert launcher.first_failure({0: stopped, 1: failed}) == (1, failed)
    assert launcher.first_failure({1: stopped, 0: failed})[0] == 0
    early = ProcessFailure(local_rank=1, pid=3, exitcode=1, error_file="-")
    early.timestamp = 99
    assert launcher.first_failure({0: failed, 1: early}) == (1, early)
