"""Training checkpoints of a run on several ranks, and resuming on a different number of them.

* One process, or DDP (every rank holds the whole model): rank 0 writes the usual single-process
  step folder (``model.safetensors`` + ``optimizer.pt``, see :mod:`tformer.checkpoint`).
* FSDP (each rank holds a 1/N shard of every parameter and of its optimizer state): every rank writes
  its shard with ``torch.distributed.checkpoint`` (DCP) into ``<step folder>/shards/`` — one
  ``__<rank>_0.distcp`` file per rank plus ``.metadata``, which records each tensor's global shape
  and which rank holds which slice. Rank 0 then adds the config, tokenizer and trainer state, and
  moves the run's pointer last, so the folder is complete before the run points at it (the same
  atomicity as the single-process checkpoints). The last step of the run also gets a consolidated
  ``model.safetensors`` for generation and HF conversion; any other sharded step is consolidated
  in memory by :func:`tformer.checkpoint.load_model`.

Resuming reads either kind into any layout: DCP reslices the shards for the new world size (or
reads whole tensors in one process), and a single-file checkpoint is loaded into FSDP through an
unsharded replica whose state each rank slices to its shard. Optimizer states go through
``get_state_dict`` / ``set_state_dict``, which key them by parameter name, so the layouts agree.
"""

from __future__ import annotations

import contextlib
import shutil
import warnings
from pathlib import Path
from typing import Callable

import torch

from tformer.checkpoint import SHARDS, first_line, load_model, read_pointer, single_process_load
from tformer.training.runs import save_training_checkpoint
from tformer.errors import CheckpointError
from tformer.training.distributed import Distributed


def save(dist: Distributed, run_dir: Path, step: int, model: torch.nn.Module, optimizer, tokenizer,
         state: dict, final: bool = False) -> Path:
    """Write step ``step``'s checkpoint on every rank's behalf (every rank calls this); the step folder."""
    run_dir = Path(run_dir)
    rel = f"ckpt/step-{step:07d}"
    folder = run_dir / rel
    if not dist.sharded:
        if dist.is_main:
            opt = {"optimizer": optimizer.state_dict(), "torch_rng": torch.get_rng_state()}
            save_training_checkpoint(run_dir, step, model, tokenizer, state, opt)
        dist.barrier()
        return folder
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    dist.barrier()
    if (read_pointer(run_dir, missing_ok=True) or {}).get("latest") == rel:
        return folder                                       # this step is saved already (every rank sees it)
    if dist.is_main and folder.exists():                    # a partial folder from a killed run
        shutil.rmtree(folder)
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state, "torch_rng": torch.get_rng_state()},
             checkpoint_id=folder / SHARDS)
    plain = dist.full_model(model) if final else None      # collective: every rank takes part
    if dist.is_main:           # the config, tokenizer and trainer state (+ the consolidated weights), then the pointer
        save_training_checkpoint(run_dir, step, plain if final else model, tokenizer, state, None, weights=final)
    dist.barrier()
    return folder


def load(dist: Distributed, folder: Path, model: torch.nn.Module, optimizer, opt_state: dict | None,
         new_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer]) -> None:
    """Load weights, optimizer state and torch RNG of checkpoint ``folder`` into this rank's
    ``model`` / ``optimizer`` (sharded or not). ``opt_state``: the single-file optimizer state
    (``None`` for a sharded folder); ``new_optimizer(model)`` builds the run's optimizer for a replica."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    folder = Path(folder)
    if (folder / SHARDS).is_dir():
        from torch.distributed import checkpoint as dcp
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state, "torch_rng": torch.get_rng_state()}
        try:
            with single_process_load():
                dcp.load(state, checkpoint_id=folder / SHARDS, no_dist=not dist.active)
        except Exception as e:   # DCP raises its own error types for missing or damaged shards
            raise CheckpointError(f"cannot read the sharded checkpoint in {folder / SHARDS} ({first_line(e)}); "
                                  f"restore it or resume from another step folder.") from e
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        torch.set_rng_state(state["torch_rng"])
        return
    replica = load_model(folder)
    if not dist.sharded:
        model.load_state_dict(replica.state_dict())
        optimizer.load_state_dict(opt_state["optimizer"])
    else:                           # whole tensors -> each rank keeps its slice
        replica_opt = new_optimizer(replica)
        replica_opt.load_state_dict(opt_state["optimizer"])
        model_state, optim_state = get_state_dict(replica, replica_opt)
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
                       options=StateDictOptions(full_state_dict=True))
    torch.set_rng_state(opt_state["torch_rng"])
