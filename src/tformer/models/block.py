"""One transformer block: the residual sub-layers that join a token mixer, an optional cross-attention
and a feed-forward (the pieces themselves: ``nn/norms.py``, ``nn/feed_forward.py``, ``mixers/``).

A block is two residual sub-layers, a token mixer (tokens talk to each other: attention, or any
mixer registered in ``tformer.mixers``) then a feed-forward (each token thinks alone). ``norm_placement`` decides where the norm sits:

- ``pre``  (GPT-2, Llama): ``x = x + f(norm(x))``: the residual stream is never normalised,
  which keeps gradients well-behaved in deep stacks.
- ``post`` (Vaswani et al., BERT): ``x = norm(x + f(x))``.

With ``post_norms`` (Gemma 2 and 3) a pre-norm sub-layer's output is normalised too before the add,
``x = x + norm'(f(norm(x)))``: four norms per block, ``attn_post_norm`` and ``ffn_post_norm`` beside
``attn_norm`` and ``ffn_norm``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tformer.ops.dropout import dropout as cpu_dropout
from tformer.config import TransformerConfig
from tformer.nn.feed_forward import make_feed_forward
from tformer.nn.norms import make_norm
from tformer.mixers import mixer_class
from tformer.mixers.base import Shared, Step
from tformer.nn.positions import RotaryEmbedding

Tensor = torch.Tensor


class Block(nn.Module):
    """One layer: a token mixer, an optional cross-attention, a feed-forward; each a residual sub-layer.

    Args:
        config: the model's config (``norm_placement``, ``dropout``, the mixer of each layer, ...).
        layer: this block's index; picks its mixer from ``config.layer_mixers()``.
        shared: objects every layer's mixer reuses (the rotary table).
        cross_attention: an encoder-decoder attention module (Vaswani et al.'s decoder, e.g.
            :class:`~tformer.mixers.attention.CrossAttention`) to run as a sub-layer between the
            mixer and the feed-forward, or ``None``. It is called as ``cross_attention(h,
            context=context, mask=context_mask)``.
        rope: a rotary table, when not given through ``shared`` (direct use).

    The mixer is stored as ``attn`` (and its norm as ``attn_norm``) whatever it is, the
    cross-attention as ``cross_attn`` (``cross_norm``), so checkpoints and the HF converters keep
    the names they have always had.
    """

    def __init__(self, config: TransformerConfig, layer: int = 0, shared: Shared | None = None, *,
                 cross_attention: nn.Module | None = None, rope: RotaryEmbedding | None = None):
        super().__init__()
        shared = shared if shared is not None else Shared(rope=rope)
        self.layer = layer
        self.pre_norm = config.norm_placement == "pre"
        self.p_drop = config.dropout
        self.attn_norm = make_norm(config)
        self.attn = mixer_class(config.layer_mixers()[layer])(config, layer, shared)
        self.cross_norm = make_norm(config) if cross_attention is not None else None
        self.cross_attn = cross_attention
        self.ffn = make_feed_forward(config)
        self.ffn_norm = make_norm(config) if self.ffn is not None else None
        # Gemma: the sub-layer's output is normalised before the residual add (None: not)
        self.attn_post_norm = make_norm(config) if config.post_norms else None
        self.ffn_post_norm = make_norm(config) if config.post_norms and self.ffn is not None else None

    def _residual(self, x: Tensor, norm: nn.Module, f, dropout: bool, post: nn.Module | None = None) -> Tensor:
        if self.pre_norm:
            out = f(norm(x))
            return x + cpu_dropout(post(out) if post is not None else out, self.p_drop, dropout)
        return norm(x + cpu_dropout(f(x), self.p_drop, dropout))

    def forward(
        self,
        x: Tensor,
        step: Step | None = None,
        state=None,
        *,
        mask: Tensor | None = None,
        positions: Tensor | None = None,
        context: Tensor | None = None,
        context_mask: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor | None]:
        """``x (B, T, C)`` -> ``(B, T, C)``; with ``step.return_weights`` also the mixer's weights.

        Args:
            step: positions, padding mask and the rest, computed once by the model; built from
                ``mask``/``positions`` when ``None`` (direct use).
            state: this layer's mixer state (inference), or ``None``.
            context, context_mask: the encoder's output and its padding mask (cross-attention).
        """
        if step is None:
            if positions is None:
                positions = torch.arange(x.shape[1], device=x.device)
            step = Step(positions=positions, mask=mask, dropout=self.training)
        if step.hooks is not None:
            return self.forward_hooked(x, step, state, context, context_mask)
        weights = None

        def mix(h: Tensor) -> Tensor:
            nonlocal weights
            out = self.attn(h, step, state)
            if step.return_weights:
                out, weights = out
            return out

        x = self._residual(x, self.attn_norm, mix, step.dropout, self.attn_post_norm)
        if self.cross_attn is not None:
            x = self._residual(x, self.cross_norm, lambda h: self.cross_attn(h, context=context, mask=context_mask),
                               step.dropout)
        if self.ffn is not None:
            x = self._residual(x, self.ffn_norm, self.ffn, step.dropout, self.ffn_post_norm)
        return (x, weights) if step.return_weights else x

    def forward_hooked(self, x: Tensor, step: Step, state, context: Tensor | None,
                       context_mask: Tensor | None) -> Tensor | tuple[Tensor, Tensor | None]:
        """:meth:`forward` visiting the hook points ``blocks.{i}.hook_resid_pre``, ``hook_attn_out``
        (the mixer's output), ``hook_resid_mid``, ``hook_mlp_out``, ``hook_resid_post`` (all
        ``(B, T, C)``) and the feed-forward's ``mlp.hook_*``; each ``step.hooks(name, t)`` may
        return a replacement. The same sums as :meth:`forward`, in the same order."""
        hook, p = step.hooks, f"blocks.{self.layer}."
        weights = None

        def mix(h: Tensor) -> Tensor:
            nonlocal weights
            out = self.attn(h, step, state)
            if step.return_weights:
                out, weights = out
            post = self.attn_post_norm                        # TransformerLens's Gemma hooks after ln1_post
            return hook(p + "hook_attn_out", post(out) if post is not None else out)

        def feed_forward(h: Tensor) -> Tensor:
            hooked = getattr(self.ffn, "hooked", None)        # a feed-forward without hook points runs plain
            out = hooked(h, hook, p + "mlp.") if hooked is not None else self.ffn(h)
            post = self.ffn_post_norm
            return hook(p + "hook_mlp_out", post(out) if post is not None else out)

        x = hook(p + "hook_resid_pre", x)
        x = hook(p + "hook_resid_mid", self._residual(x, self.attn_norm, mix, step.dropout))
        if self.cross_attn is not None:
            x = self._residual(x, self.cross_norm, lambda h: self.cross_attn(h, context=context, mask=context_mask),
                               step.dropout)
        if self.ffn is not None:
            x = self._residual(x, self.ffn_norm, feed_forward, step.dropout)
        x = hook(p + "hook_resid_post", x)
        return (x, weights) if step.return_weights else x
