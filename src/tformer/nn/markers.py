"""Markers a module sets on its parameters or sub-modules, read by the model's init and the optimizer.

- :func:`mark_residual` on a projection that writes into the residual stream: the model scales its
  initialisation by ``1/sqrt(2·n_layers)`` (GPT-2), so the stream's variance does not grow with depth.
- :func:`no_weight_decay` on parameters that weight decay must leave alone (Mamba's ``A_log`` and
  ``D``, which are matrices but not weights in the usual sense; the optimizer already spares every
  1-D parameter: biases and norm gains).
"""

from __future__ import annotations

import torch.nn as nn


def mark_residual(linear: nn.Module) -> nn.Module:
    """Mark ``linear`` as writing into the residual stream (its init is scaled by 1/sqrt(2·n_layers))."""
    linear.writes_residual = True
    return linear


def writes_residual(module: nn.Module) -> bool:
    return getattr(module, "writes_residual", False)


def no_weight_decay(*params: nn.Parameter) -> None:
    """Exclude ``params`` from weight decay (:func:`tformer.training.optim.param_groups` reads it)."""
    for p in params:
        p.no_weight_decay = True


def decays(name: str, param: nn.Parameter) -> bool:
    """Whether weight decay applies: matrices (``dim >= 2``) not marked :func:`no_weight_decay`."""
    return param.dim() >= 2 and not getattr(param, "no_weight_decay", False)
