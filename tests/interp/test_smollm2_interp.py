"""The real model: hooks leave SmolLM2's logits unchanged, and its induction heads are where the
doc's figure puts them. Criterion (fixed before the run): on 4 sequences of 20 repeated random
tokens the best head scores above 0.5 and lies in layers 15..25, and the mean over all 270 heads is
below 0.15 (induction is a property of a few heads, not of attention in general)."""

from __future__ import annotations

import torch

from tformer.checkpoint import load_model
from tformer.interp import run_with_cache
from tformer.interp.induction import induction_scores, repeated_tokens


def test_smollm2_hooks_and_induction_heads(smollm2):
    _, folder = smollm2
    model = load_model(folder).eval()
    ids = repeated_tokens(20, batch=4, vocab=(1000, 10000), start=1, seed=1)
    with torch.no_grad():
        plain = model(ids[:1])[0]
        hooked, cache = run_with_cache(model, ids[:1], names=lambda n: n.endswith("hook_resid_post"))
    assert (hooked - plain).abs().max() <= 1e-4 * plain.abs().max()
    assert len(cache) == 30
    scores = induction_scores(model, ids)
    assert scores.shape == (30, 9)
    layer, head = divmod(int(scores.argmax()), 9)
    assert scores.max() > 0.5 and 15 <= layer <= 25, (layer, head, float(scores.max()))
    assert scores.mean() < 0.15
