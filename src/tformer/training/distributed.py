"""Training on several processes: the process group torchrun describes, the share of each step's
batch a rank computes, and the DDP / FSDP wrappers.

torchrun (``python -m torch.distributed.run``) starts one process per rank and tells each, through
its environment, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``. With
``WORLD_SIZE`` > 1 the trainer joins the process group (gloo on CPU; NCCL for CUDA tensors and gloo
for CPU ones on a GPU machine), and every rank then runs the same loop in lockstep.

The global batch of step s is the one a single process draws: ``grad_accum`` micro-batches of
``batch_size`` windows, micro-batch m drawn with the seed ``(seed, 0, s, m)``. Number its
``G = batch_size * grad_accum`` rows micro-batch first; rank r computes rows ``[r·G/N, (r+1)·G/N)``,
in pieces of at most ``batch_size`` rows (so every rank runs the same number of forward passes, which
FSDP's collectives need). Each piece's mean loss is divided by ``G / (rows · N)``, and DDP and FSDP
average gradients over the N ranks, so the gradient is that of the mean loss over all G rows,
the single process's gradient:

    sum_r (1/N) sum_pieces rows·N/G · mean(piece) = (1/G) sum over all G rows of each row's mean loss
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np
import torch

from tformer.errors import ConfigError
from tformer.exits import STOP_SIGNALS
from tformer.training.data import get_batch

STOP_CODES = (None, "done", "time", "term", "int")   # agreed over ranks by taking the largest code


def under_torchrun() -> bool:
    """Whether this process was started by torchrun (or another launcher setting ``WORLD_SIZE``)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


@dataclass
class Distributed:
    """This process's place in the job. ``world_size == 1``: one process, no process group."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    backend: str | None = None
    sharded: bool = field(default=False)       # set by :meth:`wrap` for FSDP

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1

    # ------------------------------------------------------------------ devices and models
    def place(self, device: str) -> str:
        """The device of this rank: ``cuda`` becomes ``cuda:<LOCAL_RANK>`` (one GPU per rank)."""
        if device == "cuda" and self.active:
            torch.cuda.set_device(self.local_rank)
            return f"cuda:{self.local_rank}"
        return device

    def wrap(self, model: torch.nn.Module, strategy: str, device: str) -> torch.nn.Module:
        """What the loop calls forward on: the model itself (one process), a DDP wrapper, or the model
        sharded in place with FSDP2 (each block one unit, the rest — embeddings, head — the root)."""
        if not self.active:
            return model
        if strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel
            ids = [self.local_rank] if device.startswith("cuda") else None
            # buffers (RoPE tables, masks) are computed identically on every rank: no broadcast per forward
            return DistributedDataParallel(model, device_ids=ids, forward_sync_buffers=False)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh(device.split(":")[0], (self.world_size,))
        for block in getattr(model, "blocks", []):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.sharded = True
        return model

    @contextlib.contextmanager
    def gradient_sync(self, forward: torch.nn.Module, last: bool):
        """Around one piece's forward and backward: communicate gradients only after the last piece."""
        if not self.active or last:
            yield
        elif hasattr(forward, "no_sync"):                       # DDP
            with forward.no_sync():
                yield
        elif hasattr(forward, "set_requires_gradient_sync"):    # FSDP2
            forward.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                forward.set_requires_gradient_sync(True)
        else:
            yield

    def full_model(self, model: torch.nn.Module) -> torch.nn.Module | None:
        """An unsharded copy of a sharded model on rank 0 (``None`` on the others; every rank must call it)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from tformer.models import build_model
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not self.is_main:
            return None
        plain = build_model(model.config)
        plain.load_state_dict(state)
        return plain

    # ------------------------------------------------------------------ data
    def check_batch(self, batch_size: int, grad_accum: int) -> None:
        if (batch_size * grad_accum) % self.world_size:
            raise ConfigError(
                f"batch_size x grad_accum = {batch_size * grad_accum} sequences cannot be split evenly over "
                f"{self.world_size} ranks; set batch_size or grad_accum so that their product is a multiple "
                f"of {self.world_size}.")

    def pieces(self, batch_size: int, grad_accum: int) -> list[list[tuple[int, int, int]]]:
        """This rank's rows of the global batch, in pieces of at most ``batch_size`` rows; a piece
        is a list of ``(micro, lo, hi)``: rows ``lo:hi`` of micro-batch ``micro``."""
        self.check_batch(batch_size, grad_accum)
        per = batch_size * grad_accum // self.world_size
        first = self.rank * per
        out = []
        for p0 in range(first, first + per, batch_size):
            p1, j, ranges = min(p0 + batch_size, first + per), p0, []
            while j < p1:
                micro, lo = divmod(j, batch_size)
                hi = min(batch_size, lo + p1 - j)
                ranges.append((micro, lo, hi))
                j += hi - lo
            out.append(ranges)
        return out

    def batches(self, data: np.ndarray, batch_size: int, grad_accum: int, block: int, seed: tuple[int, ...]):
        """Yield ``(last, x, y, share)`` for this rank's pieces of the step whose micro-batch m is
        drawn with ``(*seed, m)``; divide a piece's mean loss by ``share`` (see the module docstring)."""
        drawn: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        pieces = self.pieces(batch_size, grad_accum)
        for i, ranges in enumerate(pieces):
            xs, ys = [], []
            for micro, lo, hi in ranges:
                if micro not in drawn:
                    drawn[micro] = get_batch(data, batch_size, block, (*seed, micro))
                xs.append(drawn[micro][0][lo:hi])                          # (hi - lo, block)
                ys.append(drawn[micro][1][lo:hi])
            rows = sum(hi - lo for _, lo, hi in ranges)
            x, y = (xs[0], ys[0]) if len(xs) == 1 else (torch.cat(xs), torch.cat(ys))
            yield i == len(pieces) - 1, x, y, batch_size * grad_accum / (rows * self.world_size)

    def eval_share(self, n_batches: int):
        """Yield ``(k, weight)``: evaluation batch k and 1 for the ranks' batches ``k = rank, rank + N, ...``,
        padded with weight-0 repeats so every rank runs the same number of forward passes."""
        for i in range(-(-n_batches // self.world_size)):
            k = i * self.world_size + self.rank
            yield (k, 1.0) if k < n_batches else (k % n_batches, 0.0)

    # ------------------------------------------------------------------ agreement between ranks
    def pending_stop(self) -> str | None:
        """A stop signal that reached this rank since the last call (``"term"``, ``"int"``), taken from
        the pending set (see :func:`hold_stop_signals`); ``None`` in one process or when none came."""
        if not self.active or threading.current_thread() is not threading.main_thread():
            return None
        info = signal.sigtimedwait(list(STOP_SIGNALS), 0)
        return STOP_SIGNALS[info.si_signo] if info is not None else None

    def _device(self) -> str:
        return f"cuda:{self.local_rank}" if self.backend and "nccl" in self.backend else "cpu"

    def sum(self, value: float) -> float:
        """The sum of ``value`` over ranks (the value itself in one process)."""
        if not self.active:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self._device())
        torch.distributed.all_reduce(t)
        return float(t)

    def agree(self, why: str | None) -> str | None:
        """The stop request of any rank (Ctrl-C, time limit) becomes every rank's: they leave the loop together."""
        if not self.active:
            return why
        t = torch.tensor([STOP_CODES.index(why)], device=self._device())
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return STOP_CODES[int(t)]

    def barrier(self) -> None:
        if self.active:
            torch.distributed.barrier()

    @contextlib.contextmanager
    def main_first(self):
        """Rank 0 runs the block first (e.g. tokenising the corpus into the shared cache), then the others."""
        if not self.is_main:
            self.barrier()
        yield
        if self.is_main:
            self.barrier()


_CURRENT: Distributed | None = None
_HELD: set | None = None          # the signal mask before hold_stop_signals, while it holds


def hold_stop_signals() -> None:
    """Under torchrun, keep SIGTERM and SIGINT *pending* in this rank instead of delivering them; the
    loop takes them with :meth:`Distributed.pending_stop` at a step boundary.

    Why: torchrun signals every rank, and a delivered signal interrupts whatever system call a thread
    is in. The gloo threads of the process group are in socket calls all the time, and an interrupted
    collective left the ranks one collective apart (seen: one rank in the stop agreement, the other
    in DDP's gradient all-reduce, until torchrun killed both unsaved). Blocked in the main thread
    before any process-group thread starts, the signals are blocked in every thread created after
    (threads inherit the mask), so none is interrupted. A thread started before (an OpenMP worker of
    the model's construction) that takes one runs the loop's handler, as in one process.
    Called by :func:`setup` just before it joins the process group; :func:`shutdown` releases it.
    """
    global _HELD
    if under_torchrun() and threading.current_thread() is threading.main_thread() and _HELD is None:
        _HELD = signal.pthread_sigmask(signal.SIG_BLOCK, set(STOP_SIGNALS))


def release_stop_signals() -> None:
    """Undo :func:`hold_stop_signals` (at :func:`shutdown`): the signals still pending are dropped
    first (the loop has acted on the first; the rank is ending), then the mask is as it was, so
    nothing this process starts later inherits it (a blocked mask survives fork and exec)."""
    global _HELD
    if _HELD is None or threading.current_thread() is not threading.main_thread():
        return
    while signal.sigtimedwait(list(STOP_SIGNALS), 0) is not None:
        pass
    signal.pthread_sigmask(signal.SIG_SETMASK, _HELD)
    _HELD = None


def setup(device: str = "auto", timeout_s: float = 600.0) -> Distributed:
    """This process's :class:`Distributed`; joins the process group on first call under torchrun.

    ``timeout_s`` bounds every collective: a rank that waits longer for a dead or stuck peer raises
    instead of hanging (torchrun also stops the other ranks as soon as one exits with an error).
    """
    global _CURRENT
    if _CURRENT is not None:
        return _CURRENT
    if not under_torchrun() or int(os.environ["WORLD_SIZE"]) == 1:
        _CURRENT = Distributed()
        return _CURRENT
    hold_stop_signals()                  # before init_process_group starts gloo's threads
    dist = torch.distributed
    cuda = device != "cpu" and torch.cuda.is_available()
    backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    _CURRENT = Distributed(rank=dist.get_rank(), world_size=dist.get_world_size(),
                           local_rank=int(os.environ.get("LOCAL_RANK", 0)),
                           local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", 1)), backend=backend)
    return _CURRENT


def shutdown() -> None:
    """Leave the process group (at the end of ``tformer train``)."""
    global _CURRENT
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    release_stop_signals()
    _CURRENT = None


def local_ranks() -> int:
    """Processes torchrun started on this machine (1 outside torchrun): they share its cores."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
