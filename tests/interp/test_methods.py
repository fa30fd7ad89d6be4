"""The methods built on the hooks, each against a direct computation (tolerances stated per test)."""

from __future__ import annotations

import pytest
import torch

from tl_reference import V, tformer_model

from tformer.interp import run_with_cache
from tformer.interp.attribution import direct_logit_attribution, head_outputs, per_layer
from tformer.interp.induction import induction_scores, repeated_tokens
from tformer.interp.lens import fit_tuned_lens, kl_to_final, logit_lens, residual_stack
from tformer.interp.patching import ablate_heads, head_ablation_effects


def ids(seed: int, shape=(2, 8)) -> torch.Tensor:
    return torch.randint(0, V, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_direct_logit_attribution_sums_to_the_logit(family):
    """Pieces + constant = the logit (difference) within 1e-4; the heads sum to attn_out - b_O within 1e-5."""
    model = tformer_model(family)
    x = ids(0)
    with torch.no_grad():
        logits, cache = run_with_cache(model, x)
        tokens, against = torch.tensor([3, 4]), torch.tensor([5, 6])
        labels, contrib, const = direct_logit_attribution(model, cache, tokens, against)
        target = logits[:, -1].gather(1, tokens[:, None])[:, 0] - logits[:, -1].gather(1, against[:, None])[:, 0]
        assert (contrib.sum(0) + const - target).abs().max() <= 1e-4
        bias = model.blocks[1].attn.out_proj.bias
        heads = head_outputs(model, cache, 1).sum(2) + (bias if bias is not None else 0)
        assert (heads - cache["attn_out", 1]).abs().max() <= 1e-5
        layer_labels, layer_contrib = per_layer(labels, contrib)
    assert layer_labels == ["embed", "L0 attn", "L0 mlp", "L1 attn", "L1 mlp"]
    assert (layer_contrib.sum(0) - contrib.sum(0)).abs().max() <= 1e-5
    assert len([l for l in labels if "H" in l]) == 2 * 4


def test_logit_lens_ends_at_the_logits_and_reads_each_layer():
    model = tformer_model("llama")
    x = ids(1)
    with torch.no_grad():
        lens = logit_lens(model, x)
        logits, cache = run_with_cache(model, x)
        direct = model.lm_head(model.final_norm(cache["resid_pre", 1]))
    assert lens.shape == (3, 2, 8, V)
    assert (lens[-1] - logits).abs().max() <= 1e-5
    assert (lens[1] - direct).abs().max() <= 1e-6


def test_tuned_lens_beats_the_logit_lens_on_held_out_tokens():
    """Criterion: after 60 Adam steps the tuned lens's KL to the final distribution, on tokens it was
    not trained on, is below the logit lens's at every block input."""
    model = tformer_model("gpt2")
    train = [ids(s, (8, 16)) for s in range(10, 14)]
    lens = fit_tuned_lens(model, train, steps=60, lr=3e-3)
    held_out = ids(99, (8, 16))
    with torch.no_grad():
        logits, stack = residual_stack(model, held_out)
        tuned = kl_to_final(logits, lens(model, stack)[:-1]).mean(dim=(1, 2))
        plain = kl_to_final(logits, model.lm_head(model.final_norm(stack[:-1]))).mean(dim=(1, 2))
    assert (tuned < plain).all(), (tuned, plain)
    assert all(p.requires_grad for p in model.parameters())          # the model is handed back trainable


def test_zero_and_mean_ablation_equal_the_weight_edits():
    """Zero: head h's columns of W_O zeroed. Mean: those columns zeroed and W_O,h·mean(z_h) moved
    into the bias. Both within 1e-5."""
    model = tformer_model("gpt2")
    x, reference = ids(2), ids(3, (4, 8))
    l, h, hs = 1, 2, model.config.head_dim
    with torch.no_grad():
        zero = ablate_heads(model, x, {l: [h]}, "zero")
        mean = ablate_heads(model, x, {l: [h]}, "mean", reference=reference)
        _, cache = run_with_cache(model, reference)
        z_mean = cache["z", l][:, :, h].mean(dim=(0, 1))                    # (hs,)
        proj = model.blocks[l].attn.out_proj
        w_h = proj.weight[:, h * hs:(h + 1) * hs].clone()
        proj.weight[:, h * hs:(h + 1) * hs] = 0
        zero_edit = model(x)[0]
        proj.bias += w_h @ z_mean
        mean_edit = model(x)[0]
    assert (zero - zero_edit).abs().max() <= 1e-5
    assert (mean - mean_edit).abs().max() <= 1e-5
    assert (zero - mean).abs().max() > 1e-3                            # the two modes differ


def test_head_ablation_effects_table():
    model = tformer_model("llama")
    x = ids(4)
    metric = lambda logits: logits[:, -1, 7].mean()  # noqa: E731
    table = head_ablation_effects(model, x, metric, "zero")
    with torch.no_grad():
        one = metric(ablate_heads(model, x, {0: [3]}, "zero"))
    assert table.shape == (2, 4)
    assert abs(table[0, 3] - one) <= 1e-6


def test_induction_scores_equal_a_loop_over_the_stripe():
    model = tformer_model("gpt2")
    n = 6
    x = repeated_tokens(n, batch=3, vocab=(2, V), start=1, seed=0)
    assert x.shape == (3, 13) and torch.equal(x[:, 1:n + 1], x[:, n + 1:])
    scores = induction_scores(model, x)
    _, cache = run_with_cache(model, x)
    for l in range(2):
        pattern = cache["pattern", l]
        by_loop = torch.stack([pattern[:, :, i, i - n + 1] for i in range(n - 1, 2 * n + 1)], -1).mean(dim=(0, -1))
        assert (scores[l] - by_loop).abs().max() <= 1e-6
