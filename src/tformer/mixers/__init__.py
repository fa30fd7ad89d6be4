"""Token mixers and their registry: a new mixer is one module plus one line here.

``MIXERS`` maps a config name to ``"module:Class"``, imported on first use (so a mixer's module
may import anything in tformer without a cycle). ``TransformerConfig.mixer`` is one name for
every layer, or a list of names repeated over the stack (``["mamba", "mamba", "attention"]``:
attention every third layer). See :mod:`tformer.mixers.base` for the protocol.
"""

from __future__ import annotations

import importlib

from tformer.errors import ConfigError

MIXERS: dict[str, str | type] = {
    "attention": "tformer.mixers.attention:MultiHeadAttention",
    "mamba": "tformer.mixers.mamba:MambaMixer",
    "longformer": "tformer.mixers.longformer:LongformerAttention",
    "bigbird": "tformer.mixers.bigbird:BigBirdAttention",
    "performer": "tformer.mixers.performer:PerformerAttention",
    "linformer": "tformer.mixers.linformer:LinformerAttention",
}


def mixer_class(name: str) -> type:
    """The class registered as ``name``."""
    if name not in MIXERS:
        raise ConfigError(f"mixer={name!r} is not known; choose one of {', '.join(sorted(MIXERS))}.")
    target = MIXERS[name]
    if isinstance(target, type):
        return target
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)


def check_config(config) -> None:
    """Resolve every layer's mixer name and let each mixer class refuse what it cannot do with
    ``config`` (its ``check_config``).

    Raises:
        ConfigError: a name that is not registered, or a setting the mixer refuses.
    """
    for name in dict.fromkeys(config.layer_mixers()):
        cls = mixer_class(name)
        if hasattr(cls, "check_config"):
            cls.check_config(config)


def register_mixer(name: str, target: str | type) -> None:
    """Register a mixer that lives outside tformer (a class, or ``"module:Class"``) as ``name``.
    A checkpoint that uses it loads in any process that registered it first."""
    MIXERS[name] = target
