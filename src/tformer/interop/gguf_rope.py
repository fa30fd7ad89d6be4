"""A GGUF file's RoPE scaling -> ``config.rope_scaling`` (:mod:`tformer.nn.rope_scaling`), and back.

llama.cpp keeps a scaled RoPE in one of two ways (its ``gguf-py/gguf/constants.py`` names the keys):

- ``{arch}.rope.scaling.type`` ``linear`` or ``yarn`` with ``rope.scaling.factor``,
  ``rope.scaling.original_context_length`` (YaRN's ``L``, else ``context_length``) and optionally
  ``rope.scaling.yarn_beta_fast`` / ``yarn_beta_slow`` (default 32 and 1) and
  ``rope.scaling.yarn_attn_factor``, which llama.cpp multiplies into YaRN's own ``0.1·ln(factor) + 1``.
- ``rope_factors_short.weight`` and ``rope_factors_long.weight`` (``phi3``): LongRoPE's two sets of divisors,
  with ``rope.scaling.original_context_length`` and ``rope.scaling.attn_factor`` (default 1), which llama.cpp
  multiplies into cos and sin with either set; read as ``longrope`` with that ``attention_factor``. llama.cpp
  picks the long set when the context it is run with exceeds the original one (:mod:`tformer.nn.rope_scaling`).
- ``rope_freqs.weight``: one divisor per frequency (head_dim/2 float32), how ``convert_hf_to_gguf.py``
  stores Llama 3.1's ``llama3`` scaling. It is read back as ``llama3`` when the divisors are those of the
  published parameters (low/high frequency factors 1 and 4, original context 8,192, factor = the largest
  divisor) to float32 rounding, so the model exports to HF again; else as ``factors``, exactly as stored.

What llama.cpp would do differently is refused, naming the key: another scaling type (LongRoPE, in
part 2), an ``attn_factor`` (other than LongRoPE's) or YaRN extrapolation or log multiplier other than the defaults.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from tformer.errors import CheckpointError
from tformer.interop.gguf_reader import GGUFFile
from tformer.nn.rope_scaling import frequencies, plain_frequencies

ROPE_KEYS = ("rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length",
             "rope.scaling.attn_factor", "rope.scaling.finetuned", "rope.scaling.yarn_attn_factor",
             "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow", "rope.scaling.yarn_ext_factor",
             "rope.scaling.yarn_log_multiplier")
LLAMA3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _refuse(f: GGUFFile, key: str, value, why: str) -> CheckpointError:
    return CheckpointError(f"{f.path}: GGUF metadata {key}={value!r} cannot be honoured: {why}")


def check_rope(f: GGUFFile, arch: str) -> None:
    """Refuse the RoPE metadata tformer cannot honour (see the module docstring)."""
    kind = f.field(f"{arch}.rope.scaling.type", "none")
    factor = f.field(f"{arch}.rope.scaling.factor")
    if kind not in ("none", "linear", "yarn"):
        raise _refuse(f, f"{arch}.rope.scaling.type", kind, "tformer implements linear and YaRN scaling from these "
                      "keys (and Llama 3.1's from rope_freqs.weight).")
    if kind == "none" and factor not in (None, 0.0, 1.0):
        raise _refuse(f, f"{arch}.rope.scaling.factor", factor, "a factor without rope.scaling.type says no scaling.")
    if kind != "none" and (factor is None or not factor > 0):
        raise _refuse(f, f"{arch}.rope.scaling.factor", factor, f"{kind} scaling needs a factor > 0.")
    if kind != "none" and "rope_freqs.weight" in f.tensors:
        raise _refuse(f, f"{arch}.rope.scaling.type", kind, "the file also holds rope_freqs.weight; tformer does not "
                      "combine per-frequency divisors with another scaling.")
    for key, default in (("attn_factor", 1.0), ("yarn_ext_factor", 1.0), ("yarn_log_multiplier", 0.0)):
        value = f.field(f"{arch}.rope.scaling.{key}")
        longrope = key == "attn_factor" and "rope_factors_long.weight" in f.tensors      # LongRoPE's own factor
        if value is not None and value != default and not (key == "yarn_ext_factor" and value < 0) and not longrope:
            raise _refuse(f, f"{arch}.rope.scaling.{key}", value, f"tformer implements the default ({default}) only.")


def rope_scaling(f: GGUFFile, arch: str, config) -> dict | None:
    """``config.rope_scaling`` for the file (``None``: plain RoPE); ``config`` gives head_dim and the base."""
    kind = f.field(f"{arch}.rope.scaling.type", "none")
    factor = f.field(f"{arch}.rope.scaling.factor")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        out = {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings":
               f.field(f"{arch}.rope.scaling.original_context_length", config.context_length)}
        for key, ours in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if f.field(f"{arch}.rope.scaling.{key}") is not None:
                out[ours] = float(f.field(f"{arch}.rope.scaling.{key}"))
        attn = f.field(f"{arch}.rope.scaling.yarn_attn_factor")
        if attn is not None and attn != 1.0:
            out["attention_factor"] = float(attn) * (0.1 * math.log(factor) + 1.0)
        return out
    if "rope_factors_long.weight" in f.tensors:
        return longrope(f, arch, config)
    if "rope_freqs.weight" not in f.tensors:
        return None
    return from_divisors(f, f.array("rope_freqs.weight"), config)


def longrope(f: GGUFFile, arch: str, config) -> dict:
    """``rope_factors_short/long.weight`` and their keys as ``longrope`` (see the module docstring)."""
    sets = {}
    for which in ("short", "long"):
        name = f"rope_factors_{which}.weight"
        a = f.array(name) if name in f.tensors else np.zeros(0)
        if a.shape != (config.head_dim // 2,) or not np.isfinite(a).all() or not (a > 0).all():
            raise CheckpointError(f"{f.path}: tensor {name} must hold {config.head_dim // 2} finite divisors > 0 (one "
                                  f"per frequency of a {config.head_dim}-wide head); the file is damaged.")
        sets[which] = [float(x) for x in a]
    original = f.field(f"{arch}.rope.scaling.original_context_length")
    if original is None:
        raise _refuse(f, f"{arch}.rope.scaling.original_context_length", None, "LongRoPE needs the original context "
                      "at which it switches to rope_factors_long.")
    return {"rope_type": "longrope", "short_factor": sets["short"], "long_factor": sets["long"],
            "original_max_position_embeddings": int(original),
            "attention_factor": float(f.field(f"{arch}.rope.scaling.attn_factor", 1.0))}


def from_divisors(f: GGUFFile, a: np.ndarray, config) -> dict:
    """``rope_freqs.weight`` as ``llama3`` (when it is Llama 3.1's) or ``factors``."""
    hs = config.head_dim
    if a.shape != (hs // 2,) or not np.isfinite(a).all() or not (a > 0).all():
        raise CheckpointError(f"{f.path}: tensor rope_freqs.weight must hold {hs // 2} finite divisors > 0 (one per "
                              f"frequency of a {hs}-wide head); it has shape {list(a.shape)}; the file is damaged.")
    divisors = torch.from_numpy(a.astype(np.float64))
    llama3 = {"rope_type": "llama3", "factor": float(np.float32(a.max())), **LLAMA3}
    scaled, _ = frequencies(hs, config.rope_base, llama3)
    if torch.allclose(plain_frequencies(hs, config.rope_base) / scaled, divisors, rtol=1e-6, atol=0):
        return llama3
    return {"rope_type": "factors", "factors": [float(x) for x in a]}


def divisors(scaling: dict, head_dim: int, base: float) -> np.ndarray | None:
    """The ``rope_freqs.weight`` of a ``llama3`` or ``factors`` scaling (float32), else ``None``."""
    if scaling is None or scaling["rope_type"] not in ("llama3", "factors"):
        return None
    scaled, _ = frequencies(head_dim, base, scaling)
    return (plain_frequencies(head_dim, base) / scaled).numpy().astype(np.float32)
