"""Linformer as a token mixer: keys and values projected along the sequence to ``k`` rows (an encoder layer).

Options (``config.mixer_options["linformer"]``):

- ``k`` (default 256): projected length.
- ``sharing`` (default ``"headwise"``): ``"none"`` (an ``E, F`` pair per head), ``"headwise"`` (one
  pair per layer, shared by its heads) or ``"kv"`` (``E = F``, one matrix per layer), the paper's §4
  options. (Its fourth, one matrix for all layers, is not offered.)

``E`` and ``F`` are ``(heads or 1, k, context_length)`` parameters; a shorter input uses their first
``n`` columns. Causal configs are refused: ``E`` mixes the whole sequence into every projected key.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from tformer.ops.linformer import linformer_attention
from tformer.config import TransformerConfig
from tformer.errors import ConfigError
from tformer.mixers.base import Shared, Step
from tformer.mixers.projected import ProjectedAttention

Tensor = torch.Tensor

SHARING = ("none", "headwise", "kv")


class LinformerAttention(ProjectedAttention):
    """Low-rank projected attention (Wang et al., 2020); protocol of :mod:`tformer.mixers.base`."""

    name = "linformer"
    OPTIONS = ("k", "sharing")

    def __init__(self, config: TransformerConfig, layer: int = 0, shared: Shared | None = None):
        super().__init__(config, layer, shared)
        self.k = self.option("k", 256)
        self.sharing = self.option("sharing", "headwise")
        heads = config.n_heads if self.sharing == "none" else 1
        bound = 1.0 / math.sqrt(self.k)                                       # the linformer package's init
        self.E = nn.Parameter(torch.empty(heads, self.k, config.context_length).uniform_(-bound, bound))
        self.F = None if self.sharing == "kv" else nn.Parameter(torch.empty_like(self.E).uniform_(-bound, bound))

    def forward(self, x: Tensor, step: Step, state=None):
        """``x (B, T, C)`` -> ``(B, T, C)``, ``T <= context_length``."""
        B, T, _ = x.shape
        q, k, v = self.project(x, step)
        out = linformer_attention(q, self.expand(k), self.expand(v), self.E, self.E if self.F is None else self.F,
                                  key_mask=self.key_mask(step, B, T))       # (B, nh, T, hs)
        return self.finish(out, step)

    @classmethod
    def count_parameters(cls, config: TransformerConfig) -> int:
        k = config.mixer_option(cls.name, "k", 256)
        k = max(k) if isinstance(k, (list, tuple)) else k
        sharing = config.mixer_option(cls.name, "sharing", "headwise")
        heads = config.n_heads if sharing == "none" else 1
        return super().count_parameters(config) + heads * k * config.context_length * (1 if sharing == "kv" else 2)

    @classmethod
    def extra_training_flops_per_token(cls, config: TransformerConfig, seq_len: int, layer: int = 0) -> int:
        """Per token and head, ``4·k·e`` multiply-adds: its key and value through ``E`` and ``F``
        (``E[:, t]`` meets every head's key), and its query against the ``k`` projected keys and
        values; times 2 FLOPs, 3 with the backward, ``nh`` heads. ``6 · parameters`` already
        counted ``E`` and ``F`` as if each weight met one token, so that is taken off (the
        result may be negative: ``E`` has a column per position, each used by one token)."""
        k = config.mixer_option(cls.name, "k", 256)
        ef = cls.count_parameters(config) - super().count_parameters(config)
        return 24 * config.n_heads * k * config.head_dim - 6 * ef

    @classmethod
    def check_config(cls, config: TransformerConfig) -> None:
        super().check_config(config)
        if config.causal:
            raise ConfigError("mixer='linformer' cannot be causal: its projection E sums over the whole sequence, "
                              "so every projected key would carry future tokens; use causal=False (an encoder).")
        cls.int_option(config, "k", 256)
        if isinstance(config.mixer_option(cls.name, "k", 256), (list, tuple)):
            raise ConfigError("mixer_options['linformer']['k'] must be one integer for every layer.")
        if config.mixer_option(cls.name, "sharing", "headwise") not in SHARING:
            raise ConfigError(f"mixer_options['linformer']['sharing'] must be one of {', '.join(SHARING)}.")
