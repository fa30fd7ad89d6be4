"""LoRA adapters in PEFT's folder format, both ways, for Llama-family decoders.

A PEFT LoRA folder is ``adapter_config.json`` (``peft_type: LORA``, ``r``, ``lora_alpha``,
``target_modules``, ...) and ``adapter_model.safetensors`` whose keys name the HF modules under
``PeftModel``'s wrapper:

    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight     (r, in)
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight     (out, r)

tformer's adapter ``q_proj`` on the fused ``blocks.{i}.attn.qkv_proj`` is exactly that pair (see
:mod:`tformer.training.lora`), so saving and loading renames tensors and nothing else.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from torch import nn

from tformer.errors import CheckpointError
from tformer.interop.llama import PREFIX
from tformer.io import atomic_write, atomic_write_json
from tformer.training.lora import LoRASpec, add_lora, hf_names, lora_modules, lora_sites, model_targets
from tformer.training.peft_fused import fuse

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
WRAPPER = "base_model.model."                      # PeftModel -> LoraModel -> the HF model
KEY = re.compile(rf"^{re.escape(WRAPPER + PREFIX)}(layers\.\d+\.(?:self_attn|mlp)\.\w+)\.lora_([AB])\.weight$")


def save_adapter(model: nn.Module, folder: str | Path, base_model: str | None = None) -> Path:
    """Write ``model``'s adapters as a PEFT LoRA folder (atomically, file by file); the folder."""
    from safetensors.torch import save_file

    spec: LoRASpec = getattr(model, "lora_spec", None)
    modules = lora_modules(model)
    if spec is None or not modules:
        raise CheckpointError("this model has no LoRA adapters to save; fine-tune it with --method lora first.")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for path, m in modules.items():
        for name in m.slices:
            key = WRAPPER + PREFIX + hf_names(path, name)
            tensors[f"{key}.lora_A.weight"] = m.lora_A[name].detach().contiguous().cpu()
            tensors[f"{key}.lora_B.weight"] = m.lora_B[name].detach().contiguous().cpu()
    targets, patterns = sorted(spec.targets), {"rank_pattern": {}, "alpha_pattern": {}}
    fused = peft_fused_modules(model.config)
    if fused:                                       # Phi-3's qkv_proj / gate_up_proj (training/peft_fused.py)
        c = model.config
        q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        sizes = {"self_attn.q_proj": q, "self_attn.k_proj": kv, "self_attn.v_proj": kv, "mlp.gate_proj": c.d_ff,
                 "mlp.up_proj": c.d_ff}
        tensors, targets, *pair = fuse(tensors, fused, sizes, spec.r, spec.alpha, spec.rslora)
        patterns = dict(zip(patterns, pair))
    atomic_write(folder / WEIGHTS, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    atomic_write_json(folder / CONFIG, {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": spec.r, "lora_alpha": spec.alpha, "lora_dropout": spec.dropout, "use_rslora": spec.rslora,
        "target_modules": targets, "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
        "modules_to_save": None, "layers_to_transform": None, **patterns,
        "init_lora_weights": True, "use_dora": False, "revision": None})
    return folder


def peft_fused_modules(c) -> dict[str, tuple[str, ...]]:
    """The fused HF modules (and their parts) of the family ``c`` exports as: its module's ``PEFT_FUSED``."""
    from tformer.interop.hf import FAMILIES

    module = FAMILIES.get(c.hf_model_type or c.name)
    return getattr(module, "PEFT_FUSED", {})


def read_adapter(folder: str | Path) -> tuple[LoRASpec, dict[str, torch.Tensor]]:
    """``(spec, tensors)`` of a PEFT LoRA folder; refuses what tformer's LoRA does not compute
    (DoRA, biases, per-module ranks, extra trained modules), naming the field, and settings that are not
    what PEFT writes (a rank, alpha or dropout that is not a number in range), naming the value."""
    spec, tensors, _ = _read(folder)
    return spec, tensors


def _read(folder: str | Path) -> tuple[LoRASpec, dict[str, torch.Tensor], dict]:
    """:func:`read_adapter`, and the folder's ``adapter_config.json`` as read."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / CONFIG).is_file() or not (folder / WEIGHTS).is_file():
        raise CheckpointError(f"{folder} is not a PEFT adapter folder: it needs {CONFIG} and {WEIGHTS} "
                              f"(PeftModel.save_pretrained writes both).")
    try:
        cfg = json.loads((folder / CONFIG).read_text(encoding="utf-8"))
        tensors = load_file(str(folder / WEIGHTS))
    except Exception as e:  # json / safetensors errors
        raise CheckpointError(f"cannot read the adapter in {folder}: {e}; restore it or save it again.") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{folder}/{CONFIG} holds a JSON {type(cfg).__name__}, not an object of settings "
                              f"(\"r\", \"lora_alpha\", \"target_modules\", ...); restore it or save the adapter again.")
    refusals = [("peft_type", "LORA"), ("bias", "none"), ("use_dora", False), ("fan_in_fan_out", False),
                ("modules_to_save", None), ("rank_pattern", {}), ("alpha_pattern", {})]
    for key, want in refusals:
        if cfg.get(key, want) not in (want, None if want == {} else want):
            raise CheckpointError(f"{folder}/{CONFIG} has {key}={cfg[key]!r}; tformer loads plain LoRA adapters "
                                  f"only ({key}={want!r}).")
    found = {}
    for key, t in tensors.items():
        m = KEY.match(key)
        if m is None:
            raise CheckpointError(f"{folder}/{WEIGHTS} holds {key!r}, which is not a LoRA matrix of a Llama-family "
                                  f"projection; tformer loads adapters on q/k/v/o/gate/up/down_proj only (not on "
                                  f"Phi-3's fused qkv_proj / gate_up_proj, whose one A cannot be split exactly).")
        found[(m.group(1), m.group(2))] = t
    targets = sorted({name.rsplit(".", 1)[-1] for name, _ in found})
    where = f"{folder}/{CONFIG}"
    r = int(setting(cfg, "r", 8, where, "a whole number of at least 1", lambda v: v >= 1 and float(v).is_integer()))
    alpha = setting(cfg, "lora_alpha", r, where, "a finite number", lambda v: math.isfinite(v))
    dropout = setting(cfg, "lora_dropout", 0.0, where, "a number in [0, 1)", lambda v: 0.0 <= v < 1.0)
    rslora = cfg.get("use_rslora", False)
    if not isinstance(rslora, bool) and rslora is not None:
        raise CheckpointError(f"{where} has use_rslora={rslora!r}; it must be true or false.")
    spec = LoRASpec(r=r, alpha=float(alpha), dropout=float(dropout), targets=tuple(targets), rslora=bool(rslora))
    return spec, {f"{name}.lora_{ab}": t for (name, ab), t in found.items()}, cfg


def setting(cfg: dict, key: str, default, where: str, what: str, ok) -> int | float:
    """``cfg[key]`` (``default`` when absent or null) when it is a JSON number that passes ``ok``; otherwise
    one sentence naming the file, the key, the value and what it must be (a string, a NaN, a negative rank)."""
    value = cfg.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
        raise CheckpointError(f"{where} has {key}={json.dumps(value)}; it must be {what}. Restore the file or "
                              f"save the adapter again.")
    return value


def check_target_modules(model: nn.Module, cfg_targets, folder: Path) -> None:
    """Refuse ``target_modules`` that name modules ``model`` does not have, as PEFT refuses them ("Target modules
    ... not found in the base model"): a list of names, each a projection of the model, or a regular expression
    that matches at least one of its projections (PEFT's ``re.fullmatch`` on the module's full name)."""
    if cfg_targets is None:
        return
    present = model_targets(model)
    where = f"{folder}/{CONFIG}"
    if cfg_targets == "all-linear":                  # PEFT's word for every linear but the head
        return
    if isinstance(cfg_targets, str):
        names = [PREFIX + hf for slices in lora_sites(model, present).values() for hf in slices]
        try:
            pattern = re.compile(cfg_targets)
        except re.error as e:
            raise CheckpointError(f"{where} has target_modules={cfg_targets!r}, not a valid regular expression "
                                  f"({e}).") from None
        if not any(pattern.fullmatch(n) for n in names):
            raise CheckpointError(f"{where} has target_modules={cfg_targets!r}, which matches no module of this model "
                                  f"(its projections: {', '.join(present)}); PEFT refuses such an adapter too.")
        return
    if not isinstance(cfg_targets, list) or not all(isinstance(t, str) for t in cfg_targets):
        raise CheckpointError(f"{where} has target_modules={json.dumps(cfg_targets)}; it must be a list of module "
                              f"names or a regular expression.")
    absent = [t for t in cfg_targets if t.rsplit(".", 1)[-1] not in present]
    if absent:
        raise CheckpointError(f"{where} names target_modules {', '.join(absent)}, which this model does not have (its "
                              f"projections: {', '.join(present)}); PEFT refuses such an adapter too: load it onto "
                              f"the model it was trained for.")


def load_adapter(model: nn.Module, folder: str | Path) -> nn.Module:
    """Put the adapters of a PEFT LoRA folder on ``model`` (a tformer decoder without adapters; in
    place, returned). Only the layers and projections the file has get adapters."""
    spec, tensors, cfg = _read(folder)
    check_target_modules(model, cfg.get("target_modules"), Path(folder))
    wanted = {name for name in (k.rsplit(".", 1)[0] for k in tensors)}
    sites = {path: {hf: rows for hf, rows in slices.items() if hf in wanted}
             for path, slices in lora_sites(model, spec.targets).items()}
    sites = {p: s for p, s in sites.items() if s}
    if len({hf for s in sites.values() for hf in s}) != len(wanted):
        missing = sorted(wanted - {hf for s in sites.values() for hf in s})
        raise CheckpointError(f"the adapter in {folder} adapts {missing[:3]}, which this model does not have "
                              f"(another number of layers?); load it onto the model it was trained for.")
    add_lora(model, spec, sites)
    with torch.no_grad():
        for path, m in lora_modules(model).items():
            for name in m.slices:
                hf = hf_names(path, name)
                for ab, holder in (("A", m.lora_A), ("B", m.lora_B)):
                    t = tensors[f"{hf}.lora_{ab}"]
                    if t.shape != holder[name].shape:
                        raise CheckpointError(f"{folder}: {hf}.lora_{ab} has shape {tuple(t.shape)} but this model "
                                              f"needs {tuple(holder[name].shape)}; load it onto its own base model.")
                    holder[name].copy_(t)
    return model
