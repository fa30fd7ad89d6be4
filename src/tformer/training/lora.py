"""LoRA (Hu et al., 2021, "LoRA: Low-Rank Adaptation of Large Language Models") on a decoder's linears.

A frozen projection ``y = x W^T + b`` (``W: (out, in)``) learns a low-rank update per adapted slice
of its output rows ``[s, e)``:

    y[..., s:e] += (alpha / r) · B · A · dropout(x)       A: (r, in) (Kaiming-uniform), B: (e - s, r) (zeros)

so at initialisation the model is exactly the base model. tformer fuses q, k and v into one
``qkv_proj`` (rows ``[0, q) [q, q+kv) [q+kv, q+2kv)``), so "LoRA on q and v" is one adapter per
slice of the fused output: each slice's ``A`` and ``B`` are the ``lora_A`` / ``lora_B`` of PEFT's
separate ``q_proj`` / ``v_proj`` and map onto them one to one (:mod:`tformer.training.peft_adapter`).
The slices' ``A`` matrices are stacked into one matmul and their ``B`` into one block matrix
(:meth:`LoRALinear.b_full`), so the update is two small matmuls and one add.

:func:`merge_lora` folds ``(alpha / r) · B · A`` into ``W[s:e]`` and gives back plain ``nn.Linear``.
Targets are named as HuggingFace's Llama modules (``q_proj k_proj v_proj o_proj gate_proj up_proj
down_proj``), the names PEFT's ``target_modules`` use; :func:`lora_sites` maps them to tformer's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tformer.errors import ConfigError
from tformer.interop.llama import LAYER, QKV
from tformer.quant import blocks as block_formats
from tformer.quant.block_linear import BlockLinear
from tformer.quant.tiled import tiled_linear
from tformer.training.frozen_cast import cache_frozen_casts, cast_weight

# The HF Llama projections LoRA can adapt (``all`` = every one).
TARGETS = QKV + tuple(h.split(".")[-2] for _, h in LAYER if h.endswith("proj.weight"))


@dataclass(frozen=True)
class LoRASpec:
    """Where and how big: ``targets`` (HF names, see :data:`TARGETS`), rank ``r``, ``alpha`` (the
    update is scaled by ``alpha / r``, or ``alpha / sqrt(r)`` with ``rslora``) and ``dropout`` on the
    adapter's input."""

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q_proj", "v_proj")
    rslora: bool = False

    def __post_init__(self) -> None:
        if self.r < 1:
            raise ConfigError(f"lora_r={self.r} must be at least 1; use e.g. --set lora_r=8.")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"lora_dropout={self.dropout} must be in [0, 1); use e.g. --set lora_dropout=0.05.")
        bad = [t for t in self.targets if t not in TARGETS]
        if bad or not self.targets:
            raise ConfigError(f"LoRA target(s) {bad or '(none)'} are not known; choose among {', '.join(TARGETS)} "
                              f"(comma-separated), or 'all'.")

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.r) if self.rslora else self.r)


class LoRALinear(nn.Module):
    """A frozen linear (``weight (out, in)``, ``bias``, the wrapped ``nn.Linear``'s own tensors under the
    same names, so a checkpoint's base keys are unchanged) plus one adapter per output slice.

    QLoRA: over a :class:`~tformer.quant.block_linear.BlockLinear` the frozen base stays the GGUF file's
    blocks (``blocks``, ``fmt``; ``weight`` is ``None``), multiplied in float tile by tile
    (:func:`tformer.quant.tiled.tiled_linear`: never widened as a whole); the adapters are float32.

    Args:
        base: the linear to adapt; its parameters are frozen.
        slices: adapter name (the HF module, e.g. ``q_proj``) -> ``(start, stop)`` output rows.
    """

    def __init__(self, base: nn.Linear, slices: dict[str, tuple[int, int]], spec: LoRASpec):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.fmt = base.fmt if isinstance(base, BlockLinear) else None
        if self.fmt is not None:                           # QLoRA: the file's blocks, as they are
            self.weight = None
            self.register_buffer("blocks", base.blocks)
            self.register_buffer("bias", base.bias)
        else:
            self.weight, self.bias = base.weight, base.bias
        for p in (self.weight, self.bias):
            if p is not None:
                p.requires_grad_(False)
        self.slices = dict(sorted(slices.items(), key=lambda kv: kv[1]))
        self.r, self.scale = spec.r, spec.scale
        self.dropout = nn.Dropout(spec.dropout) if spec.dropout else nn.Identity()
        device, dtype = (base.weight.device, base.weight.dtype) if self.fmt is None else (base.blocks.device, torch.float32)
        self.lora_A = nn.ParameterDict({n: nn.Parameter(torch.empty(spec.r, self.in_features, device=device, dtype=dtype))
                                        for n in self.slices})
        self.lora_B = nn.ParameterDict({n: nn.Parameter(torch.zeros(e - s, spec.r, device=device, dtype=dtype))
                                        for n, (s, e) in self.slices.items()})
        for a in self.lora_A.values():
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))      # PEFT's (and nn.Linear's) init; B = 0

    def delta_weight(self, name: str) -> torch.Tensor:
        """``(alpha / r) · B · A``: ``(e - s, in)``, the update of rows ``slices[name]``."""
        return self.scale * (self.lora_B[name] @ self.lora_A[name])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x W^T + b + z B_full^T`` with ``z = dropout(x) [A_1; ...; A_k]^T`` ``(..., r·k)``: one matmul
        for every slice's ``A``, one for every slice's ``B`` and one add. ``B_full`` (:meth:`b_full`)
        puts ``scale · B_i`` in slice i's rows and columns and zeros elsewhere, so no output is sliced
        and concatenated (whose backward fills a zero gradient of the whole output per slice)."""
        if self.fmt is not None:
            y = tiled_linear(x, self.blocks, self.fmt, self.bias)                   # (..., out)
        else:
            y = F.linear(x, cast_weight(self, self.weight, x.device.type), self.bias)   # (..., out)
        names = list(self.slices)
        a = self.lora_A[names[0]] if len(names) == 1 else torch.cat([self.lora_A[n] for n in names])
        z = F.linear(self.dropout(x), a)                                           # (..., r · k)
        return y + F.linear(z, self.b_full())

    def b_full(self) -> torch.Tensor:
        """``(out, r · k)``: rows ``[s_i, e_i)``, columns ``[i·r, (i+1)·r)`` hold ``scale · B_i``; zero elsewhere."""
        k, r = len(self.slices), self.r
        rows, pos = [], 0
        for i, (n, (s, e)) in enumerate(self.slices.items()):
            b = self.lora_B[n]                                                     # (e - s, r)
            if s > pos:
                rows.append(b.new_zeros(s - pos, k * r))
            rows.append(F.pad(self.scale * b, (i * r, (k - 1 - i) * r)))
            pos = e
        if pos < self.out_features:
            rows.append(rows[-1].new_zeros(self.out_features - pos, k * r))
        return rows[0] if len(rows) == 1 else torch.cat(rows)

    def base_weight(self) -> torch.Tensor:
        """The frozen ``W (out, in)`` in float: the weight, or the blocks dequantised (a copy)."""
        if self.fmt is not None:
            return block_formats.dequantize(self.blocks, self.fmt)
        return self.weight.detach()

    def merged(self) -> nn.Linear:
        """A plain ``nn.Linear`` whose weight is ``W`` plus every slice's update (over blocks: the
        dequantised blocks plus the update, float32)."""
        w0 = self.base_weight()
        out = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                        device=w0.device, dtype=w0.dtype)
        with torch.no_grad():
            w = w0.clone()
            for n, (s, e) in self.slices.items():
                w[s:e] += self.delta_weight(n).to(w.dtype)
            out.weight.copy_(w)
            if self.bias is not None:
                out.bias.copy_(self.bias)
        return out

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, r={self.r}, scale={self.scale:g}, " \
               f"slices={self.slices}"


def lora_sites(model: nn.Module, targets: tuple[str, ...]) -> dict[str, dict[str, tuple[int, int]]]:
    """tformer module path -> {HF module name: output rows}, for each block of a decoder.

    The HF name is the full one under the Llama model (``layers.{i}.self_attn.q_proj``); its last part
    keys the adapter inside the :class:`LoRALinear`."""
    c = model.config
    if c.model != "decoder" or c.mixer != "attention" or not hasattr(model, "blocks"):
        raise ConfigError(f"LoRA adapts decoders of softmax attention (Llama-family layout); this model is a "
                          f"{c.model} with mixer {c.mixer!r}. Fine-tune it with --method full.")
    present = model_targets(model)
    absent = [t for t in targets if t not in present]
    if absent:
        gated = "" if "gate_proj" in present else " (its MLP is not gated: no gate_proj)"
        raise ConfigError(f"LoRA target(s) {', '.join(absent)} are not projections of this model{gated}; it has "
                          f"{', '.join(present)}: choose among those (lora_targets=all adapts every one).")
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    rows = dict(zip(QKV, ((0, q), (q, q + kv), (q + kv, q + 2 * kv))))
    sites: dict[str, dict[str, tuple[int, int]]] = {}
    for i in range(c.n_layers):
        fused = {f"layers.{i}.self_attn.{t}": rows[t] for t in QKV if t in targets}
        if fused:
            sites[f"blocks.{i}.attn.qkv_proj"] = fused
        for ours, hf in LAYER:
            short = hf.split(".")[-2]
            if short in targets:
                module = model.get_submodule(f"blocks.{i}.{ours.rsplit('.', 1)[0]}")
                sites[f"blocks.{i}.{ours.rsplit('.', 1)[0]}"] = {
                    f"layers.{i}.{hf.rsplit('.', 1)[0]}": (0, module.out_features)}
    return sites


def model_targets(model: nn.Module) -> tuple[str, ...]:
    """The HF names (of :data:`TARGETS`, in its order) of the projections ``model``'s blocks have: q, k and v
    always (the fused ``qkv_proj``), o_proj, and gate/up/down as its feed-forward has them (a plain MLP has
    no ``gate_proj``)."""
    block = dict(model.blocks[0].named_modules())
    have = {hf.split(".")[-2] for ours, hf in LAYER
            if hf.endswith("proj.weight") and isinstance(block.get(ours.rsplit(".", 1)[0]), (nn.Linear, BlockLinear))}
    return tuple(t for t in TARGETS if t in QKV or t in have)


def add_lora(model: nn.Module, spec: LoRASpec, sites: dict[str, dict[str, tuple[int, int]]] | None = None) -> nn.Module:
    """Freeze every parameter of ``model`` and put a :class:`LoRALinear` on each site (in place;
    ``model`` is returned). ``sites`` default: :func:`lora_sites` of ``spec.targets``. Adapter keys
    inside a module are the HF module's last name (``q_proj``); :func:`hf_names` gives the full ones."""
    sites = lora_sites(model, spec.targets) if sites is None else sites
    for p in model.parameters():
        p.requires_grad_(False)
    for path, slices in sites.items():
        parent, _, leaf = path.rpartition(".")
        holder = model.get_submodule(parent)
        base = getattr(holder, leaf)
        if isinstance(base, LoRALinear):
            raise ConfigError(f"{path} has LoRA adapters already; merge them (merge_lora) before adding new ones.")
        setattr(holder, leaf, LoRALinear(base, {hf.rsplit(".", 1)[-1]: rows for hf, rows in slices.items()}, spec))
    cache_frozen_casts(model)                 # the frozen base's bf16 casts, made once (frozen_cast.py)
    model.lora_spec = spec
    return model


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """tformer module path -> its :class:`LoRALinear`."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def hf_names(path: str, adapter: str) -> str:
    """The HF module (under ``model.``) of adapter ``adapter`` of tformer module ``path``:
    ``blocks.3.attn.qkv_proj`` + ``v_proj`` -> ``layers.3.self_attn.v_proj``."""
    i = path.split(".")[1]
    if adapter in QKV:
        return f"layers.{i}.self_attn.{adapter}"
    ours = path.split(".", 2)[2] + ".weight"
    hf = dict(LAYER)[ours]
    return f"layers.{i}.{hf.rsplit('.', 1)[0]}"


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its weight (in place): each :class:`LoRALinear` becomes the plain
    ``nn.Linear`` of :meth:`LoRALinear.merged`; the result is the base model's architecture."""
    for path, module in lora_modules(model).items():
        parent, _, leaf = path.rpartition(".")
        setattr(model.get_submodule(parent), leaf, module.merged())
    if hasattr(model, "lora_spec"):
        del model.lora_spec
    return model


def lora_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The trainable adapter tensors, by state-dict name."""
    return {n: p for n, p in model.named_parameters() if ".lora_A." in n or ".lora_B." in n}
