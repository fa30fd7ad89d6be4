"""What every attention mixer shares: the projections. Only the kernel between them differs.

    x (B, T, C) -> qkv_proj -> q (B, nh, T, hs), k, v (B, nkv, T, hs) -> [RoPE] -> kernel -> out_proj

:class:`ProjectedAttention` is the base of softmax attention
(:class:`~tformer.mixers.attention.MultiHeadAttention`) and of the efficient-attention mixers
(Longformer, BigBird, Performer, Linformer): one fused ``qkv_proj`` of width ``(nh + 2·nkv)·hs``
and ``out_proj`` back to ``C``, so a checkpoint's attention weights mean the same thing under every
mixer. Grouped-query K/V are expanded to ``nh`` heads only in front of a kernel that needs it
(a view, no copy); softmax attention hands them to the kernel at ``nkv`` heads.

The module-level helpers (:func:`split_heads`, :func:`merge_heads`, :func:`projection_parameters`)
also serve the cross-attention, whose queries and keys/values come from different sequences.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tformer.config import TransformerConfig
from tformer.errors import ConfigError
from tformer.mixers.base import Shared, Step
from tformer.nn.markers import mark_residual
from tformer.nn.norms import RMSNorm

Tensor = torch.Tensor


def split_heads(t: Tensor, n_heads: int) -> Tensor:
    """``(B, T, n_heads·hs)`` -> ``(B, n_heads, T, hs)``: head ``h`` is columns ``h·hs .. (h+1)·hs - 1``."""
    B, T, width = t.shape
    return t.view(B, T, n_heads, width // n_heads).transpose(1, 2)


def merge_heads(t: Tensor) -> Tensor:
    """``(B, nh, T, hs)`` -> ``(B, T, nh·hs)``: the inverse of :func:`split_heads`."""
    B, nh, T, hs = t.shape
    return t.transpose(1, 2).reshape(B, T, nh * hs)


def qk_rms_norm(t: Tensor, eps: float = 1e-6) -> Tensor:
    """QK-norm (Dehghani et al., 2023): each head's vector ``t (..., hs)`` divided by its RMS,
    ``t / sqrt(mean(t²) + eps)``, no gain; applied to q and k before RoPE (a rotation keeps the norm)."""
    return torch.nn.functional.rms_norm(t, (t.shape[-1],), eps=eps)


def projection_parameters(config: TransformerConfig) -> int:
    """W_Q, W_K, W_V (+ biases, ``qkv_bias``) and W_O (+ bias, ``bias``) of one layer:
    ``(C + b_qkv)·(nh + 2·nkv)·hs + nh·hs·C + b·C``. The same for self- and cross-attention."""
    c = config
    q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    return (c.d_model + c.qkv_bias) * (q_dim + 2 * kv_dim) + q_dim * c.d_model + c.d_model * c.bias


def qk_norm_parameters(config: TransformerConfig) -> int:
    """The QK-norm's gains of one self-attention layer: ``2·hs`` with ``qk_norm_gain``, else none."""
    return 2 * config.head_dim if config.qk_norm_gain else 0


class ProjectedAttention(nn.Module):
    """Base class: projections, RoPE and the protocol's bookkeeping; subclasses supply ``forward``.

    Args:
        config: supplies d_model, n_heads, n_kv_heads, head_dim, bias, qkv_bias, positions, causal.
        layer: index in the stack (per-layer options).
        shared: the model's shared objects; its ``rope`` table when ``config.positions == "rope"``.
        rope: the rotary table, when not given through ``shared`` (direct use).

    Attributes:
        name: the mixer's key in ``tformer.mixers.MIXERS`` (where its options live).
        SUPPORTS: which of ``"alibi"``, ``"attn_dropout"``, ``"sliding_window"`` the mixer's kernel
            honours; :meth:`check_config` refuses a config that asks for any other.
        OPTIONS: the keys the mixer reads from ``config.mixer_options[name]``.
    """

    name = ""
    SUPPORTS: frozenset[str] = frozenset()
    OPTIONS: tuple[str, ...] = ()

    def __init__(self, config: TransformerConfig, layer: int = 0, shared: Shared | None = None, *,
                 rope: nn.Module | None = None):
        super().__init__()
        c = self.config = config
        self.layer = layer
        self.n_heads, self.n_kv_heads, self.head_dim = c.n_heads, c.n_kv_heads, c.head_dim
        self.causal = c.causal
        q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        self.qkv_proj = nn.Linear(c.d_model, q_dim + 2 * kv_dim, bias=c.qkv_bias)   # one matmul for q, k and v
        self.out_proj = mark_residual(nn.Linear(q_dim, c.d_model, bias=c.bias))
        if rope is None and shared is not None:
            rope = shared.local_rope if shared.local_rope is not None and c.windowed(layer) else shared.rope
        self.rope = rope if c.positions == "rope" else None
        self.qk_norm = c.qk_norm
        if c.qk_norm_gain:          # Qwen3: RMSNorm(head_dim) with a gain, one for q and one for k, shared by heads
            self.q_norm, self.k_norm = (RMSNorm(c.head_dim, c.norm_eps, c.norm_unit_offset) for _ in "qk")

    def option(self, key: str, default=None):
        """``config.mixer_options[self.name][key]``; a list there gives one value per layer (cycled)."""
        return self.layer_option(self.config, key, default, self.layer)

    @classmethod
    def layer_option(cls, config: TransformerConfig, key: str, default, layer: int):
        """Layer ``layer``'s value of option ``key`` (what :meth:`option` reads, from the config alone)."""
        value = config.mixer_option(cls.name, key, default)
        return value[layer % len(value)] if isinstance(value, (list, tuple)) else value

    def project(self, x: Tensor, step: Step, proj: nn.Linear | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """``x (B, T, C)`` -> ``q (B, nh, T, hs)``, ``k, v (B, nkv, T, hs)`` (RoPE applied at ``step.positions``);
        ``proj`` replaces ``qkv_proj`` (Longformer's global projections)."""
        B, T, _ = x.shape
        nh, nkv, hs = self.n_heads, self.n_kv_heads, self.head_dim
        # One matmul for q, k and v, then the heads as views (split_heads written out: this runs per layer per
        # decoded token, where every Python call counts at small widths). Split before the transposes, so that
        # in training the split's backward (a cat) writes (B, T, nh+2nkv, hs) rows, the layout the
        # projection's backward reads: split after them, the cat wrote (B, nh+2nkv, T, hs) and a copy
        # followed, in every training layer and decoded token
        # (docs/training.md#how-the-cpu-training-step-is-made-fast).
        qkv = (proj or self.qkv_proj)(x).view(B, T, nh + 2 * nkv, hs)                 # (B, T, nh+2nkv, hs)
        q, k, v = (t.transpose(1, 2) for t in qkv.split([nh, nkv, nkv], dim=2))   # (B, nh|nkv, T, hs)
        if self.qk_norm:
            q, k = self.normalise_qk(q, k)
        if self.rope is not None:  # rotate the new q and k (a cache holds keys rotated when written)
            q, k = self.rope(q, step.positions), self.rope(k, step.positions)
        return q, k, v

    def normalise_qk(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """QK-norm of ``q (B, nh, T, hs)`` and ``k (B, nkv, T, hs)``: :func:`qk_rms_norm`, or with
        ``qk_norm_gain`` each head's RMSNorm with the shared gains ``q_norm`` / ``k_norm`` ``(hs,)``."""
        if hasattr(self, "q_norm"):
            return self.q_norm(q), self.k_norm(k)
        return qk_rms_norm(q), qk_rms_norm(k)

    def expand(self, t: Tensor) -> Tensor:
        """``(B, nkv, m, hs)`` -> ``(B, nh, m, hs)``: each K/V head serves ``nh / nkv`` query heads."""
        g = self.n_heads // self.n_kv_heads
        if g == 1:
            return t
        B, nkv, m, hs = t.shape
        return t[:, :, None].expand(B, nkv, g, m, hs).reshape(B, nkv * g, m, hs)

    def finish(self, out: Tensor, step: Step, weights: Tensor | None = None):
        """``(B, nh, T, hs)`` -> ``(B, T, C)`` through ``out_proj`` (plus ``weights`` if asked; ``None``
        from a kernel that has none to show)."""
        B, nh, T, hs = out.shape
        out = self.out_proj(out.transpose(1, 2).reshape(B, T, nh * hs))      # merge_heads, written out
        return (out, weights) if step.return_weights else out

    @staticmethod
    def key_mask(step: Step, batch: int, m: int) -> Tensor | None:
        """The padding mask over the ``m`` keys as ``(B, m)`` bool (``None``: no padding)."""
        if step.mask is None:
            return None
        mask = torch.broadcast_to(step.mask, (batch, 1, step.mask.shape[-2], m))
        return mask[:, 0, -1]                                                # (B, m): padding is per key

    def new_tokens(self, step: Step, batch: int, T: int) -> Tensor | None:
        """``(B, T)`` bool: which of the ``T`` new tokens are real (``None``: all): ``step.tokens``,
        or, for a step built by hand with only a padding mask over its ``start_pos + T`` keys, the
        mask's last ``T`` keys. (A static decode step's mask spans the whole state: its ``tokens``
        say it all.)"""
        if step.tokens is not None or step.mask is None or step.mask.shape[-1] != step.start_pos + T:
            return step.tokens
        return self.key_mask(step, batch, step.start_pos + T)[:, -T:]

    def new_state(self, batch_size: int, max_len: int, dtype=torch.float32, device=None):
        return None

    @classmethod
    def count_parameters(cls, config: TransformerConfig) -> int:
        """Parameters of one layer: the projections, :func:`projection_parameters`, and the QK-norm's
        gains, :func:`qk_norm_parameters` (subclasses add their own)."""
        return projection_parameters(config) + qk_norm_parameters(config)

    @classmethod
    def state_bytes(cls, config: TransformerConfig, n_tokens: int, batch_size: int = 1,
                    bytes_per_element: int = 4) -> int:
        return 0

    @classmethod
    def check_config(cls, config: TransformerConfig) -> None:
        """Refuse what the kernel does not honour (ALiBi, attention dropout, a sliding window: see
        ``SUPPORTS``) and unknown options; subclasses add theirs."""
        if config.positions == "alibi" and "alibi" not in cls.SUPPORTS:
            raise ConfigError(f"mixer={cls.name!r} has no ALiBi bias; use positions='rope', 'learned', "
                              f"'sinusoidal' or 'none'.")
        if config.attn_dropout and "attn_dropout" not in cls.SUPPORTS:
            raise ConfigError(f"mixer={cls.name!r} does not apply attention dropout; set attn_dropout=0 "
                              f"(dropout on the residual stream still applies).")
        if config.sliding_window is not None and "sliding_window" not in cls.SUPPORTS:
            raise ConfigError(f"mixer={cls.name!r} ignores sliding_window; set it to None (Longformer's "
                              f"window is mixer_options['longformer']['window']).")
        known = set(cls.OPTIONS)
        unknown = sorted(set(config.mixer_options.get(cls.name, {})) - known)
        if unknown:
            raise ConfigError(f"mixer_options[{cls.name!r}] has unknown option(s) {', '.join(unknown)}; "
                              f"known options are {', '.join(sorted(known)) or 'none'}.")

    @classmethod
    def int_option(cls, config: TransformerConfig, key: str, default: int, low: int = 1) -> list[int]:
        """The option as a list of ints (one per layer pattern entry), each checked ``>= low``."""
        value = config.mixer_option(cls.name, key, default)
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        if not values or any(not isinstance(v, int) or isinstance(v, bool) or v < low for v in values):
            raise ConfigError(f"mixer_options[{cls.name!r}][{key!r}]={value!r} must be an integer >= {low} "
                              f"(or a list of them, one per layer).")
        return values
