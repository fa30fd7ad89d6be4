"""The hook points, the cache and activation patching against TransformerLens on the same weights.

Reference: TransformerLens 4's ``TransformerBridge`` over the HF export of a random tformer model
(see ``tl_reference.py``), in compatibility mode without weight processing. Criterion, fixed before
the run: every activation both name agrees within 1e-5 (absolute, fp32; masked scores are -inf at
the same places), on a GPT-2-shaped and a Llama-shaped (RoPE, GQA, SwiGLU, RMSNorm) model; and
TransformerLens's own patching functions give the same tables as tformer.interp's within 1e-5.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformer_lens", reason="transformer-lens (the dev extra) is not installed")
pytest.importorskip("transformers", reason="transformers (the hf extra) is not installed")

from tl_reference import V, bridge, tformer_model  # noqa: E402

from tformer.interp import hook_names, run_with_cache  # noqa: E402
from tformer.interp.patching import patch_heads, patch_residual  # noqa: E402

TOL = 1e-5


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def pair(request, tmp_path_factory):
    model = tformer_model(request.param)
    return model, bridge(model, tmp_path_factory.mktemp(request.param))


def ids(seed: int, shape=(2, 9)) -> torch.Tensor:
    return torch.randint(2, V, shape, generator=torch.Generator().manual_seed(seed))


def test_every_cache_entry_matches(pair):
    model, tl = pair
    x = ids(3)
    with torch.no_grad():
        logits, cache = run_with_cache(model, x)
        tl_logits, tl_cache = tl.run_with_cache(x)
    assert set(cache.keys()) == set(hook_names(model))
    compared = [n for n in cache.keys() if n in tl_cache]
    # Every name tformer has, TransformerLens has too (ours are a subset of its names).
    assert compared == list(cache.keys())
    for name in compared:
        ours, theirs = cache[name], tl_cache[name]
        assert ours.shape == theirs.shape, name
        finite = torch.isfinite(theirs)
        assert torch.equal(torch.isfinite(ours), finite), name
        assert (ours[finite] - theirs[finite]).abs().max() <= TOL, name
    assert (logits - tl_logits).abs().max() <= TOL


def logit_diff_metric(answer: int, wrong: int):
    return lambda logits: (logits[:, -1, answer] - logits[:, -1, wrong]).mean()


def test_residual_patching_matches(pair):
    from transformer_lens.patching import get_act_patch_resid_pre

    model, tl = pair
    clean, corrupted = ids(5, (1, 7)), ids(6, (1, 7))
    metric = logit_diff_metric(10, 11)
    ours = patch_residual(model, clean, corrupted, metric)
    with torch.no_grad():
        _, clean_cache = tl.run_with_cache(clean)
        theirs = get_act_patch_resid_pre(tl, corrupted, clean_cache, metric)
    assert ours.shape == theirs.shape == (2, 7)
    assert ours.abs().max() > 1e-3                                    # the table is not all zeros
    assert (ours - theirs).abs().max() <= TOL


def test_head_patching_matches(pair):
    from transformer_lens.patching import get_act_patch_attn_head_out_all_pos, get_act_patch_attn_head_out_by_pos

    model, tl = pair
    clean, corrupted = ids(7, (1, 6)), ids(8, (1, 6))
    metric = logit_diff_metric(20, 21)
    with torch.no_grad():
        _, clean_cache = tl.run_with_cache(clean)
        all_pos = get_act_patch_attn_head_out_all_pos(tl, corrupted, clean_cache, metric)
        by_pos = get_act_patch_attn_head_out_by_pos(tl, corrupted, clean_cache, metric)
    ours = patch_heads(model, clean, corrupted, metric)
    assert ours.shape == all_pos.shape == (2, 4)
    assert (ours - all_pos).abs().max() <= TOL
    ours_by_pos = patch_heads(model, clean, corrupted, metric, by_pos=True)
    assert ours_by_pos.shape == by_pos.shape == (2, 6, 4)
    assert (ours_by_pos - by_pos).abs().max() <= TOL
