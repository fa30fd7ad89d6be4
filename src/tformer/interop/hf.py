"""HuggingFace folders <-> tformer models, one small converter module per family.

    load_hf(dir)              config.json + *.safetensors  ->  DecoderLM / EncoderModel
    save_hf(model, dir)       tformer model                ->  a folder transformers' from_pretrained loads

tformer's own checkpoint folder is written and read by ``tformer.checkpoint.save_model/load_model``.

Each family module (``gpt2``, ``llama`` for Llama/Mistral/Qwen2, ``bloom``, ``bert``, ``bart``,
``marian``) has
``config_from_hf``, ``state_from_hf``, ``config_to_hf``, ``check_exportable`` and ``state_to_hf``.
Anything a converter does not implement (scaled RoPE, an unknown activation, an unknown model_type,
an unexpected tensor) is refused with a message naming it. ``transformers`` is never imported.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

from tformer.config import TransformerConfig
from tformer.errors import CheckpointError, ConfigError
from tformer.interop import bart, bert, bigbird, bloom, gpt2, llama, longformer, mamba, marian
from tformer.interop.loader import TensorSource, read_config, read_tensors, write_folder
from tformer.models import model_class

FAMILIES = {t: module for module in (gpt2, llama, bloom, bert, mamba, longformer, bigbird, bart, marian) for t in module.MODEL_TYPES}


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
        A :class:`DecoderLM` (GPT-2, Llama, Mistral, Qwen2, BLOOM) or :class:`EncoderModel` (BERT) in
        eval mode; ``model.config.name`` is the HF ``model_type``.
    Raises:
        ValueError: for an unsupported config field or model type, or missing/unexpected tensors.
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
    """The HF family a tformer config corresponds to (its ``hf_model_type``, or a preset ``name`` that is one)."""
    for named in (config.hf_model_type, config.name):
        if named in FAMILIES:
            return named
    if config.model == "encoder-decoder":
        return "marian" if config.positions == "sinusoidal" else "bart"
    if config.mixer == "mamba":
        return "mamba"
    if not config.causal:
        return "bert"
    if config.positions == "alibi":
        return "bloom"
    if config.positions == "learned":
        return "gpt2"
    if config.positions == "rope":
        if config.qkv_bias and not config.bias:
            return "qwen2"
        return "mistral" if config.sliding_window is not None else "llama"
    raise ConfigError(f"no HuggingFace family matches positions={config.positions!r}; pass model_type "
                     f"explicitly (one of {', '.join(FAMILIES)}).")


def save_hf(model: nn.Module, folder: str | Path, model_type: str | None = None,
            max_shard_bytes: int | None = None) -> Path:
    """Write ``model`` as a HuggingFace folder (config.json + safetensors) for ``from_pretrained``.

    Args:
        model: a :class:`DecoderLM` or :class:`EncoderModel`.
        folder: output folder (created).
        model_type: HF family; default inferred from the config (:func:`infer_model_type`).
        max_shard_bytes: split the weights into shards with an index above this size.
    Raises:
        ValueError: if the family cannot express the model's config (names the field).
    """
    c = model.config
    module = family(model_type, "model_type") if model_type else family(infer_model_type(c))
    model_type = model_type or infer_model_type(c)
    module.check_exportable(c, model_type)
    state = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
    kwargs = {"mlm": "mlm_head.bias" in state} if module is bert else {}
    hf_config = {**module.config_to_hf(c, model_type, **kwargs), "dtype": str(next(model.parameters()).dtype)[6:]}
    write_folder(folder, hf_config, module.state_to_hf(state, c), max_shard_bytes)
    return Path(folder)
