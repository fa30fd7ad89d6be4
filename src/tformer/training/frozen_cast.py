"""A frozen linear's bf16 weight, cast once instead of at every step.

Under ``torch.autocast(dtype=bf16)`` every ``F.linear`` casts its fp32 weight to bf16 first. Autocast
keeps that cast only inside one autocast region and only for weights that require a gradient, so a
frozen base (LoRA) is cast afresh at every forward: on SmolLM2 that is 135 M parameters read in fp32
and written in bf16 per step, a large share of a bf16 LoRA step's time on CPU (the profile:
docs/finetune.md#where-a-steps-time-goes-profile). A frozen weight does
not change between steps, so :class:`FrozenCastLinear` keeps its cast and reuses it while the weight's
storage and version counter are the same (``load_state_dict`` / ``copy_`` bump the version, so new
values are cast again). The bf16 values are the ones autocast would make (the same round-to-nearest-
even cast), so the outputs and gradients are bit-identical; without autocast, or when the weight
requires a gradient (full fine-tuning), it is a plain ``nn.Linear``.

Memory: the cast is held between steps (2 bytes a weight), where autocast holds it from the forward to
the end of the backward (it is saved for the input's gradient) — the same peak.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def cast_weight(module: nn.Module, weight: torch.Tensor, device_type: str) -> torch.Tensor:
    """``weight`` as autocast would feed it to a matmul: the cached low-precision copy when autocast is
    on for ``device_type`` and ``weight`` is a frozen fp32 tensor, else ``weight`` itself."""
    if weight.requires_grad or weight.dtype != torch.float32 or not torch.is_autocast_enabled(device_type):
        return weight
    dtype = torch.get_autocast_dtype(device_type)
    key = (weight.data_ptr(), weight._version, dtype)
    cached = getattr(module, "_frozen_cast", None)
    if cached is None or cached[0] != key:
        with torch.no_grad():
            cached = (key, weight.to(dtype))
        module._frozen_cast = cached
    return cached[1]


class FrozenCastLinear(nn.Linear):
    """An ``nn.Linear`` whose frozen weight's autocast copy is cached (see the module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, cast_weight(self, self.weight, x.device.type), self.bias)


def cache_frozen_casts(model: nn.Module) -> nn.Module:
    """Make every plain ``nn.Linear`` of ``model`` a :class:`FrozenCastLinear` (in place; the same
    parameters, so ties such as a tied LM head and state-dict keys are kept)."""
    for m in model.modules():
        if type(m) is nn.Linear:
            m.__class__ = FrozenCastLinear        # a subclass with one changed method: no new parameters
    return model
