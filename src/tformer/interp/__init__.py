"""Looking inside a model: named hook points, an activation cache, and the methods built on them.

- :mod:`~tformer.interp.hooks`: :func:`run_with_hooks` (interventions) and :func:`run_with_cache`
  (every activation by name), over hook points named as TransformerLens names them
  (``blocks.{i}.hook_resid_pre``, ``blocks.{i}.attn.hook_pattern``, ...).
- :mod:`~tformer.interp.cache`: :class:`ActivationCache`, the cached activations and the
  decompositions of the residual stream (per layer, per head) that attribution needs.
- :mod:`~tformer.interp.lens`: the logit lens and the tuned lens.
- :mod:`~tformer.interp.attribution`: direct logit attribution per layer and per head.
- :mod:`~tformer.interp.patching`: activation patching (residual by layer and position, heads),
  head ablation (zero, mean).
- :mod:`~tformer.interp.induction`: induction-head scores on repeated random tokens.
"""

from tformer.interp.cache import ActivationCache
from tformer.interp.hooks import hook_names, run_with_cache, run_with_hooks

__all__ = ["ActivationCache", "hook_names", "run_with_cache", "run_with_hooks"]
