"""``tformer train --nproc N``: check the run, start torchrun with N local ranks, and own its lifetime.

* Before a rank starts, the settings are checked here, once: what every rank would refuse (a bad
  setting, a missing corpus, a batch that does not split over N ranks, more ranks than cores or GPUs) is one line
  from this process instead of N copies and torchrun's traceback.
* torchrun runs in a session of its own, so a signal reaches it once, from here: SIGINT, SIGTERM and
  SIGHUP sent to this process are forwarded to torchrun, which sends SIGTERM/SIGINT to each rank
  (each saves a checkpoint at the next step boundary and exits) and waits for them; this process
  waits for torchrun. If this process dies without a chance to forward (SIGKILL), the kernel sends
  torchrun SIGTERM (``PR_SET_PDEATHSIG``), with the same effect.
* torchrun runs through :func:`main` here, which turns its failure exceptions into the exit status
  of the first failing rank (a signal into 128 + its number) instead of a traceback: each rank has
  printed its own error already.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading

from tformer.checkpoint import read_pointer
from tformer.config import TransformerConfig
from tformer.errors import ConfigError
from tformer.exits import STOPPED_EXITS, exit_code_for_signal
from tformer.machine import available_cores
from tformer.training.config import (MODEL_KEYS, TRAIN_KEYS, TrainConfig, cast_value, check_language_model,
                                     check_model_settings)
from tformer.training.data import resolve_corpus
from tformer.training.distributed import Distributed

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
PR_SET_PDEATHSIG = 1


def check_ranks(nproc: int, settings: dict, preset: str | None = None, resume: bool = False) -> None:
    """Refuse, before any rank starts, a run that ``nproc`` ranks would each refuse.

    Args:
        settings: the run's settings as given (``--set`` strings, TOML values; ``data``/``out_dir`` included).
        resume: the run continues ``out_dir``'s checkpoint, whose saved settings fill what is not given.
    Raises:
        ConfigError / InputError: a bad setting, a corpus that cannot be read, a batch that does not split
            over the ranks, more ranks than cores or GPUs.
    """
    if nproc < 1:
        raise ConfigError(f"--nproc {nproc} must be at least 1; pass the number of processes to start.")
    typed = {k: cast_value(k, v) for k, v in settings.items()}
    train_kw = {k: v for k, v in typed.items() if k in TRAIN_KEYS}
    model_kw = {k: v for k, v in typed.items() if k in MODEL_KEYS}
    check_model_settings(model_kw)
    if resume:
        train_kw = {**_saved_settings(train_kw.get("out_dir")), **train_kw}
    else:
        check_language_model(TransformerConfig.from_name(preset or "tiny", **model_kw, vocab_size=256))
    cfg = TrainConfig(**train_kw)
    resolve_corpus(cfg.data, cfg.encoding)                 # a missing, empty or binary corpus
    cuda = cfg.device.startswith("cuda") or (cfg.device == "auto" and _cuda_devices() > 0)
    have, what = (_cuda_devices(), "GPU(s)") if cuda else (available_cores(), "CPU core(s) this process may use")
    if nproc > have:
        raise ConfigError(f"--nproc {nproc} starts more ranks than the {have} {what}; each rank needs one: "
                          f"pass --nproc {have} or fewer.")
    Distributed(world_size=nproc).check_batch(cfg.batch_size, cfg.grad_accum)


def launch(nproc: int, train_args: list[str]) -> int:
    """Run ``tformer train <train_args>`` on ``nproc`` local ranks through torchrun; its exit status.

    ``--standalone`` gives a c10d rendezvous on a free local port, and the ranks meet at 127.0.0.1 (one
    machine: on Linux gloo is kept on the loopback interface too); no restarts, so a failing rank ends the job.
    """
    if nproc < 1:
        raise ConfigError(f"--nproc {nproc} must be at least 1; pass the number of processes to start.")
    cmd = [sys.executable, "-m", "tformer.training.launcher", "--standalone", f"--nproc-per-node={nproc}",
           "--local-addr=127.0.0.1", "--max-restarts=0", "--monitor-interval=0.5", "-m", "tformer", "train",
           *train_args]
    env = dict(os.environ)
    if "GLOO_SOCKET_IFNAME" not in env and any(name == "lo" for _, name in socket.if_nameindex()):
        env["GLOO_SOCKET_IFNAME"] = "lo"
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_die_with_parent)

    def forward(signum, frame):
        if proc.poll() is None:
            proc.send_signal(signum)

    main_thread = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, forward) for s in FORWARDED} if main_thread else {}
    try:
        return proc.wait()                 # through forwarded signals, until torchrun and its ranks are done
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def main(argv: list[str]) -> int:
    """torchrun with ``argv``; the first failing rank's exit status instead of torchrun's traceback."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        rank, failure = first_failure(e.failures)
        code = failure.exitcode
        if code < 0:                                   # the rank was killed by signal -code
            code = exit_code_for_signal(-code)
        if code != 2 and code not in STOPPED_EXITS:    # 2: the rank said why in one line
            print(f"tformer train: rank {rank} failed with exit status {code}; its output above says why.",
                  file=sys.stderr)
        return code if 0 < code < 256 else 1
    except SignalException as e:
        return exit_code_for_signal(e.sigval)
    return 0


def first_failure(failures: dict) -> tuple[int, object]:
    """The rank that failed first, preferring one that exited by itself (exit status > 0) to one that
    torchrun stopped with a signal because another had failed; ties go to the lowest rank."""
    return min(failures.items(), key=lambda kv: (kv[1].exitcode <= 0, kv[1].timestamp, kv[0]))


def _saved_settings(out_dir: str | None) -> dict:
    """The train settings saved in ``out_dir``'s latest checkpoint ({} when there is none to read:
    the ranks then say what is wrong)."""
    try:
        pointer = read_pointer(out_dir, missing_ok=True) if out_dir else None
        if pointer is None:
            return {}
        with open(os.path.join(out_dir, pointer["latest"], "trainer.json"), encoding="utf-8") as f:
            saved = json.load(f)["train_config"]
        return {k: v for k, v in saved.items() if k in TRAIN_KEYS and k != "out_dir"}
    except Exception:
        return {}


def _cuda_devices() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _die_with_parent() -> None:
    """In the child, before exec: ask the kernel for SIGTERM when this (the parent) process dies."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):      # not Linux: no parent-death signal
        pass


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
