"""Model families and their registry: a new family is one module plus one line here.

``MODELS`` maps ``TransformerConfig.model`` to ``"module:Class"``, imported on first use.
Checkpoints, HF interop, the command line and the accounting all build models through
:func:`build_model`, never from a closed list of their own.
"""

from __future__ import annotations

import importlib
from typing import Any

from tformer.errors import ConfigError

MODELS: dict[str, str] = {
    "decoder": "tformer.models.decoder:DecoderLM",
    "encoder": "tformer.models.encoder:EncoderModel",
    "encoder-decoder": "tformer.models.seq2seq:EncoderDecoder",
    "bahdanau": "tformer.models.rnn_seq2seq:BahdanauSeq2Seq",
    "rnn-encoder-decoder": "tformer.models.rnn_seq2seq:RNNEncoderDecoder",
}

# Checkpoints written before the registry stored the class name.
LEGACY_NAMES = {"DecoderLM": "decoder", "EncoderModel": "encoder"}


def model_class(kind: str) -> type:
    """The class registered for ``kind`` (a registry key, or a legacy class name)."""
    kind = LEGACY_NAMES.get(kind, kind)
    if kind not in MODELS:
        raise ConfigError(f"model={kind!r} is not known; choose one of {', '.join(sorted(MODELS))}.")
    module, cls = MODELS[kind].split(":")
    return getattr(importlib.import_module(module), cls)


def build_model(config, **options: Any):
    """The model ``config.model`` names, built from ``config`` (``options``: constructor switches
    beyond the config, e.g. the encoder's ``mlm_head``)."""
    return model_class(config.model)(config, **options)


def __getattr__(name: str):  # ``from tformer.models import DecoderLM`` without importing every family eagerly
    for kind, target in MODELS.items():
        if target.endswith(":" + name):
            return model_class(kind)
    raise AttributeError(name)


__all__ = ["MODELS", "build_model", "model_class"]
