"""HuggingFace folders <-> tformer models, one small converter module per family.

    load_hf(dir)              config.json + *.safetensors  ->  the model its config names (build_model)
    save_hf(model, dir)       tformer model                ->  a folder transformers' from_pretrained loads

tformer's own checkpoint folder is written and read by ``tformer.checkpoint.save_model/load_model``.

A new family is one module in ``tformer/interop/`` plus its name in :data:`FAMILY_MODULES`. The
module provides the names in :data:`PROTOCOL`:

- ``MODEL_TYPES``: the HF ``model_type`` values it reads and writes; ``PREFIX``: the tensor-name
  prefix of its checkpoints;
- ``config_from_hf(hf) -> TransformerConfig`` and ``state_from_hf(src, config) -> state dict``;
- ``model_type_for(config) -> str | None``: the model type it would export a config as when the
  config names none (``None``: not this family); at most one family claims a config;
- ``check_exportable(config, model_type)``, ``config_to_hf(config, model_type, **options)`` and
  ``state_to_hf(state, config) -> HF tensors``; optionally ``export_options(state) -> options``
  when the HF config depends on the weights (BERT's MLM head).

Anything a converter does not implement (a RoPE scaling other than linear, llama3 and YaRN, an unknown
activation, an unknown model_type, an unexpected tensor) is refused with a message naming it. ``transformers`` is never imported.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import torch
import torch.nn as nn

from tformer.config import TransformerConfig
from tformer.errors import CheckpointError, ConfigError
from tformer.interop.loader import TensorSource, read_config, read_tensors, require, write_folder
from tformer.models import model_class

# The family modules of tformer.interop: a new family is one module plus its name here.
FAMILY_MODULES = ("gpt2", "gpt_neox", "llama", "qwen3", "gemma2", "gemma3", "bloom", "bert", "mamba", "longformer",
                  "bigbird", "bart", "marian")

# What every family module provides (``export_options`` is optional).
PROTOCOL = ("MODEL_TYPES", "PREFIX", "config_from_hf", "state_from_hf", "model_type_for", "check_exportable",
            "config_to_hf", "state_to_hf")

MODULES = tuple(importlib.import_module(f"tformer.interop.{name}") for name in FAMILY_MODULES)
FAMILIES = {t: module for module in MODULES for t in module.MODEL_TYPES}


def family(model_type: str | None, source: str = "config.json field model_type"):
    """The converter module for an HF ``model_type`` (``source`` says where the value came from)."""
    if model_type not in FAMILIES:
        raise CheckpointError(f"{source}={model_type!r} is not supported; "
                              f"supported model types are {', '.join(FAMILIES)}.")
    return FAMILIES[model_type]


def config_from_hf(hf: dict) -> TransformerConfig:
    """The :class:`TransformerConfig` of an HF ``config.json`` dict (refuses what it cannot express)."""
    return family(hf.get("model_type")).config_from_hf(hf)


def build_model(config: TransformerConfig, state: dict) -> nn.Module:
    """An empty model of the family ``config.model`` names, with the optional parts ``state`` has
    (a family may say which through ``options_from_state``)."""
    cls = model_class(config.model)
    options = cls.options_from_state(state) if hasattr(cls, "options_from_state") else {}
    return cls(config, **options)


def load_hf(folder: str | Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Load a HuggingFace model folder (``config.json`` and ``model.safetensors`` or a sharded index).

    Args:
        folder: the folder ``save_pretrained`` wrote.
        dtype: parameter dtype of the returned model.
    Returns:
        The model of the family the converted config names (``config.model``, built by
        :func:`build_model`) in eval mode; ``model.config.hf_model_type`` is the HF ``model_type``.
    Raises:
        CheckpointError: an unsupported model type or config field (named), a config.json without
            a field its family needs, missing or unexpected tensors, or weights that do not fit the config.
        ConfigError: config.json values that make no valid :class:`TransformerConfig`.
    """
    hf = read_config(folder)
    module = family(hf.get("model_type"))
    try:
        config = module.config_from_hf(hf)
    except KeyError as e:
        raise CheckpointError(f"{folder}/config.json lacks the field {e.args[0]!r} that a {hf.get('model_type')} "
                         f"config must have; re-save the model with transformers' save_pretrained.") from e
    config.hf_model_type = hf.get("model_type")
    src = TensorSource(read_tensors(folder), prefix=module.PREFIX)
    try:
        state = module.state_from_hf(src, config)
        src.check_consumed()
        model = build_model(config, state)
        model.load_state_dict({k: v.to(torch.float32) for k, v in state.items()}, strict=True)
    except RuntimeError as e:  # a tensor whose shape the config does not give (an edited config.json)
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        first = next((line for line in lines if line.startswith("size mismatch")), lines[-1] if lines else "")
        raise CheckpointError(f"the weights in {folder} do not fit its config.json ({first}); use the config.json "
                              f"that was saved with these weights.") from e
    return model.to(dtype).eval()


def infer_model_type(config: TransformerConfig) -> str:
    """The HF model type a tformer config corresponds to: its ``hf_model_type``, a preset ``name``
    that is one, or the one a family module claims (``model_type_for``).

    Raises:
        ConfigError: no family claims the config.
    """
    for named in (config.hf_model_type, config.name):
        if named in FAMILIES:
            return named
    for module in MODULES:
        model_type = module.model_type_for(config)
        if model_type is not None:
            return model_type
    raise ConfigError(f"no HuggingFace family matches model={config.model!r}, mixer={config.mixer!r}, "
                      f"positions={config.positions!r}; pass model_type explicitly (one of {', '.join(FAMILIES)}).")


# Gemma's switches (tformer.config), which only a module declaring HAS_GEMMA_SWITCHES expresses
GEMMA_SWITCHES = dict(norm_unit_offset=False, attn_scale=None, attn_softcap=0.0, post_norms=False, window_layers=None,
                      rope_local_base=None)


def check_plain(c, model_type: str, module) -> None:
    """Refuse what no exported family expresses: tformer's training switches that change the forward
    (QK-norm, unless the module declares ``HAS_QK_NORM``; logit soft-capping, unless it declares
    ``HAS_LOGIT_SOFTCAP``; :data:`GEMMA_SWITCHES`, unless ``HAS_GEMMA_SWITCHES``), and ReLU² in a family
    whose module does not declare ``HAS_RELU2``."""
    if not getattr(module, "HAS_LOGIT_SOFTCAP", False):
        require(c, model_type, logit_softcap=0.0)
    if not getattr(module, "HAS_GEMMA_SWITCHES", False):
        require(c, model_type, **GEMMA_SWITCHES)
    if not getattr(module, "HAS_QK_NORM", False):
        require(c, model_type, qk_norm=False)
    if c.activation == "relu2" and c.ffn == "mlp" and not getattr(module, "HAS_RELU2", False):
        raise ConfigError(f"cannot export as {model_type}: it needs an activation other than activation='relu2', "
                          f"which that family has no name for.")


def save_hf(model: nn.Module, folder: str | Path, model_type: str | None = None,
            max_shard_bytes: int | None = None) -> Path:
    """Write ``model`` as a HuggingFace folder (config.json + safetensors) for ``from_pretrained``.

    Args:
        model: a model of a family in :data:`FAMILIES` (``DecoderLM``, ``EncoderModel``, ``EncoderDecoder``).
        folder: output folder (created).
        model_type: HF family; default inferred from the config (:func:`infer_model_type`).
        max_shard_bytes: split the weights into shards with an index above this size.
    Raises:
        CheckpointError: ``model_type`` is not supported.
        ConfigError: the family cannot express the model's config (names the field), or no family
            matches it.
    """
    c = model.config
    module = family(model_type, "model_type") if model_type else family(infer_model_type(c))
    model_type = model_type or infer_model_type(c)
    check_plain(c, model_type, module)
    module.check_exportable(c, model_type)
    state = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
    options = module.export_options(state) if hasattr(module, "export_options") else {}
    hf_config = {**module.config_to_hf(c, model_type, **options), "dtype": str(next(model.parameters()).dtype)[6:]}
    write_folder(folder, hf_config, module.state_to_hf(state, c), max_shard_bytes)
    return Path(folder)
