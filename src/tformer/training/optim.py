"""The optimizers (AdamW with weight decay on matrices only; Muon on the hidden matrices with AdamW on
the rest) and the cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch

from tformer.machine import bf16_supported
from tformer.nn.markers import decays


def make_optimizer(model: torch.nn.Module, lr: float, betas: tuple[float, float], weight_decay: float,
                   device_type: str = "cpu") -> torch.optim.AdamW:
    """AdamW; matrices (embeddings, Linear weights) decay; vectors (biases, norm gains) and parameters
    marked :func:`~tformer.nn.markers.no_weight_decay` (Mamba's ``A_log`` and ``D``) do not.

    Uses the fused kernel where PyTorch has one for the device (CPU and CUDA in recent releases),
    else the foreach one.
    """
    groups = param_groups(model, weight_decay)
    try:
        return AdamW(groups, lr=lr, betas=betas, fused=True)
    except (RuntimeError, TypeError):
        return AdamW(groups, lr=lr, betas=betas, foreach=True)


def _undecorated(method):
    """``method`` without torch's lazy ``torch._dynamo`` wrappers (``functools.wraps`` keeps the function
    they wrap as ``__wrapped__``); ``method`` itself where a torch release has none."""
    return getattr(method, "__wrapped__", method)


class AdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` (the same update, kernels, state and ``state_dict``) without importing
    ``torch._dynamo`` when built or stepped: torch 2.13 wraps ``Optimizer.add_param_group`` and ``zero_grad``
    in ``torch._disable_dynamo`` and ``step`` in ``_use_grad_for_differentiable``, each importing the
    compiler stack (~70 MB resident) at its first call in eager mode too; here they call the functions those
    wrappers wrap. Saving or loading its state (``state_dict``) still imports it. Not differentiable
    (``differentiable=True`` is refused), as tformer's loop never asks for it."""

    def __init__(self, params, **kwargs):
        if kwargs.get("differentiable"):
            raise ValueError("tformer's AdamW is not differentiable; use torch.optim.AdamW for that.")
        super().__init__(params, **kwargs)

    def add_param_group(self, param_group: dict) -> None:
        _undecorated(torch.optim.Optimizer.add_param_group)(self, param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        _undecorated(torch.optim.Optimizer.zero_grad)(self, set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        return _undecorated(torch.optim.AdamW.step)(self, closure)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: what decays (by :func:`~tformer.nn.markers.decays`) and what does not."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]   # a tied matrix appears once
    return [
        {"params": [p for n, p in named if decays(n, p)], "weight_decay": weight_decay},
        {"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0},
    ]


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, decay_steps: int) -> float:
    """Linear warmup from ~0 to ``lr`` over ``warmup_steps``, cosine decay to ``min_lr`` at ``decay_steps``.

    ``step`` is 0-based (the learning rate of the ``step``-th update); past ``decay_steps`` it stays at ``min_lr``.
    """
    if step < warmup_steps:
        return lr * (step + 1) / (warmup_steps + 1)
    if step >= decay_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, decay_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)



def muon_split(model: torch.nn.Module) -> tuple[list[torch.nn.Parameter], list[tuple[str, torch.nn.Parameter]]]:
    """The hidden matrices Muon updates, and every other (name, parameter), which AdamW updates.

    Hidden matrices are the weights of the ``nn.Linear`` layers inside the network: not the LM head
    nor a matrix shared with an embedding (they map tokens, where orthogonalised updates do not
    help, as the speedrun found), and not one marked :func:`~tformer.nn.markers.no_weight_decay`.
    Embeddings, the head, norm gains and biases go to AdamW.
    """
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    hidden = {id(m.weight) for name, m in model.named_modules()
              if isinstance(m, torch.nn.Linear) and name.split(".")[-1] != "lm_head"
              and id(m.weight) not in embedded and m.weight.requires_grad
              and not getattr(m.weight, "no_weight_decay", False)}
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [p for _, p in named if id(p) in hidden], [(n, p) for n, p in named if id(p) not in hidden]


def newton_schulz(g: torch.Tensor, coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315),
                  steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """``g (m, n)``'s nearest semi-orthogonal matrix, approximately, in ``g``'s dtype: on the wide
    orientation, ``X = G / ||G||_F`` (every singular value <= 1), then ``steps`` times the quintic
    ``X ← aX + (bA + cA²)X`` with ``A = XXᵀ``, which pushes every singular value towards ~1 (into
    about (0.6, 1.2) with Jordan et al.'s coefficients) while keeping the singular vectors."""
    a, b, c = coefficients
    x = g.T if g.shape[0] > g.shape[1] else g
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T                                                   # (m', m')
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if g.shape[0] > g.shape[1] else x


class Float32Muon(torch.optim.Muon):
    """``torch.optim.Muon`` with its Newton–Schulz iteration in float32 instead of bf16: for CPUs
    without native bf16 (AVX2 only), where torch's bf16 matmuls are emulated and its Muon step measured
    over twenty times the float32 one (docs/training.md#recipes-what-a-new-run-gets-by-default).
    Same groups, hyper-parameters and state (``momentum_buffer``) as torch's, so a checkpoint moves
    between the two; the update is torch's: ``B ← μB + (1-μ)g``, ``u = (1-μ)g + μB`` (Nesterov),
    ``W ← W·(1 - lr·wd) - lr·sqrt(max(1, rows/cols))·NS(u)``."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - mu)
                update = p.grad.lerp(buf, mu) if group["nesterov"] else buf
                ortho = newton_schulz(update.float(), group["ns_coefficients"], group["ns_steps"], group["eps"])
                p.mul_(1 - lr * wd)
                p.add_(ortho.to(p.dtype), alpha=-lr * math.sqrt(max(1.0, p.shape[0] / p.shape[1])))
        return None


class MuonAdamW:
    """``torch.optim.Muon`` on the hidden matrices and AdamW on the rest (:func:`muon_split`), one
    optimizer to the loop: ``param_groups`` lists both's groups (the loop sets each group's ``lr`` to
    the schedule's rate times the group's ``lr_scale``: Muon's is ``muon_lr / lr``), ``step``,
    ``zero_grad``, ``state_dict`` and ``load_state_dict`` act on both.

    Muon (Jordan et al., 2024): momentum ``B ← μB + g``, Nesterov ``u = g + μB``, then ``u``'s nearest
    semi-orthogonal matrix by five Newton–Schulz iterations, scaled by ``sqrt(max(1, rows/cols))``.
    ``native_bf16=False`` (a CPU without it) runs the iterations in float32 (:class:`Float32Muon`).
    """

    def __init__(self, model: torch.nn.Module, lr: float, betas: tuple[float, float], weight_decay: float,
                 muon_lr: float, momentum: float = 0.95, native_bf16: bool = True):
        matrices, rest = muon_split(model)
        kind = torch.optim.Muon if native_bf16 else Float32Muon      # torch's NS is bf16: emulated without it
        # torch's Muon decays by (1 - its lr · wd) per step: wd · lr / muon_lr decays the matrices by as
        # much per step as AdamW's (1 - lr · wd) would.
        self.muon = kind([{"params": matrices, "lr_scale": muon_lr / lr}], lr=muon_lr,
                                     weight_decay=weight_decay * lr / muon_lr, momentum=momentum, nesterov=True)
        groups = [{**g, "lr_scale": 1.0} for g in _named_groups(rest, weight_decay)]
        try:
            self.adamw = AdamW(groups, lr=lr, betas=betas, fused=True)
        except (RuntimeError, TypeError):
            self.adamw = AdamW(groups, lr=lr, betas=betas, foreach=True)

    @property
    def param_groups(self) -> list[dict]:
        return self.muon.param_groups + self.adamw.param_groups

    @property
    def state(self):
        return {**self.muon.state, **self.adamw.state}

    def step(self) -> None:
        self.muon.step()
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none=set_to_none)
        self.adamw.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])


def _named_groups(named: list[tuple[str, torch.nn.Parameter]], weight_decay: float) -> list[dict]:
    return [{"params": [p for n, p in named if decays(n, p)], "weight_decay": weight_decay},
            {"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, cfg, device_type: str = "cpu"):
    """The optimizer ``cfg.optimizer`` names (a :class:`~tformer.training.config.TrainConfig`):
    ``adamw`` (:func:`make_optimizer`) or ``muon`` (:class:`MuonAdamW`)."""
    betas = (cfg.beta1, cfg.beta2)
    if cfg.optimizer == "muon":
        return MuonAdamW(model, cfg.lr, betas, cfg.weight_decay, cfg.muon_lr, cfg.muon_momentum,
                         native_bf16=bf16_supported(str(device_type)))
    return make_optimizer(model, cfg.lr, betas, cfg.weight_decay, device_type)
