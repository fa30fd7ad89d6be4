"""Named training recipes: defaults for a new ``tformer train`` run that the user did not set.

- ``classic``: nanoGPT's (GPT-2's architecture; AdamW, linear warm-up and cosine decay), the
  plain values of :class:`~tformer.training.config.TrainConfig` and the preset.
- ``fast``: what the modded-nanogpt speedrun learned since, kept where it paid in time to nanoGPT's
  own validation loss on tinyshakespeare on a CPU (benchmarks/training/train_shakespeare_char.py):
  rotary positions (``positions="rope"``), a warm-up/stable/decay schedule ending at 0 (``wsd``), a
  higher peak rate (AdamW at ``3e-3 · min(1, 128 / d_model)``: 3e-3 measured at d=128, scaled as
  1/width above it, as μP scales Adam's hidden rate) with ``beta2=0.95`` (the speedrun's; nanoGPT's 0.99
  averages the squared gradients over more steps than a 1,000-step run has to spare), ReLU² and
  zero-initialised residual projections.
  RoPE is the largest single gain in validation loss at equal steps, and with its rotation in one pass
  each way (:mod:`tformer.ops.attention_cpu`) a step costs little more than with learned positions; the
  higher rate and ``beta2=0.95`` each lowered the loss again (the screening runs:
  docs/training-speed-log.md#issue-26-the-recipes-the-kernels-and-three-machines). With RoPE the model
  is a GPT-NeoX, not a GPT-2 (``tformer convert --to-hf`` writes ``gpt_neox``); ``--set
  positions=learned`` keeps a GPT-2, which needs more steps to the target. Muon (``optimizer=muon``) is
  not in it: its Newton–Schulz iteration costs about as many FLOPs as the forward and backward at 768
  tokens a step, so on a CPU at 4L/128 a step took far longer, more than the steps it saved. QK-norm and
  the soft-capped head (``qk_norm``, ``logit_softcap``) are switches a user turns on: at this size they
  cost a step more than they gave, and no HF family expresses them (figures:
  docs/training.md#recipes-what-a-new-run-gets-by-default).
- ``auto`` (the default): ``fast`` for tformer's own training shapes (the presets ``tiny`` and
  ``shakespeare-char``) with attention in every layer, where it was measured; ``classic`` for other
  mixers (untested there) and for the presets that mirror a published model (GPT-2, Llama, Mamba,
  BERT shapes), whose architecture a user picks them for.

A recipe only fills in: a setting given with ``--set`` (or the TOML file), or fixed by the preset,
keeps its value. The chosen recipe's name is saved with the run; a resumed run keeps its settings.
Precision stays per machine (``precision=auto``: bf16 only where the CPU has native bf16).
"""

from __future__ import annotations

from typing import Any

from tformer.config import PRESETS
from tformer.errors import ConfigError

RECIPE_NAMES = ("auto", "classic", "fast")
FAST_PRESETS = ("tiny", "shakespeare-char")

# The fast recipe: the model's switches and the run's settings.
FAST_MODEL: dict[str, Any] = dict(positions="rope", activation="relu2", zero_init_residual=True)
FAST_TRAIN: dict[str, Any] = dict(schedule="wsd", min_lr=0.0, beta2=0.95)
FAST_LR_AT_128 = 3e-3                    # AdamW's peak rate at d_model = 128, scaled as 128 / d_model


def resolve_recipe(recipe: str, preset: str, mixer: Any = "attention") -> str:
    """``classic`` or ``fast``: ``recipe`` itself, or for ``auto`` the one for ``preset`` and ``mixer``."""
    if recipe not in RECIPE_NAMES:
        raise ConfigError(f"recipe={recipe!r} is not known; choose one of {', '.join(RECIPE_NAMES)}.")
    if recipe != "auto":
        return recipe
    return "fast" if preset in FAST_PRESETS and mixer == "attention" else "classic"


def apply_recipe(recipe: str, preset: str, model_kw: dict[str, Any], train_kw: dict[str, Any]
                 ) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(model settings, run settings)`` with the recipe's values where neither the user's settings
    nor the preset set the field; the run settings name the resolved recipe."""
    name = resolve_recipe(recipe, preset, model_kw.get("mixer", PRESETS.get(preset, {}).get("mixer", "attention")))
    model, train = dict(model_kw), {**train_kw, "recipe": name}
    if name == "fast":
        fixed = PRESETS.get(preset, {})
        model.update({k: v for k, v in FAST_MODEL.items() if k not in model and k not in fixed})
        train.update({k: v for k, v in FAST_TRAIN.items() if k not in train})
        if "lr" not in train:
            width = model.get("d_model", fixed.get("d_model", 128))
            train["lr"] = FAST_LR_AT_128 * min(1.0, 128 / width)    # not above the measured rate when narrower
    return model, train
