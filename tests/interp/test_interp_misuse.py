"""``tformer.interp`` misused (issue 49, items 16 and 17): each mistake is one sentence naming the hook point,
head, layer or argument, never an error deep inside torch and never a silently wrong result.

Item 17 (wrong results, said nothing): a hook returning ``t[:1]`` for a batch of two gave (1, T, V) logits;
a (C,) return was broadcast to every position; ``cache["resid_pre", n_layers + 3]`` returned layer 3;
``ablate_heads(..., {0: [-1]})`` ablated the last head."""

from __future__ import annotations

import pytest
import torch

from tl_reference import V, tformer_model

from tformer.errors import InputError
from tformer.interp import run_with_cache, run_with_hooks
from tformer.interp.lens import fit_tuned_lens
from tformer.interp.patching import ablate_heads, head_ablation_effects, patch_heads, patch_residual

X = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(0))
POINT = "blocks.0.hook_resid_pre"


@pytest.fixture(scope="module")
def model():
    return tformer_model("llama")


@pytest.mark.parametrize("ret, words", [
    (lambda t: t.double(), "returned float64"),
    (lambda t: t.tolist(), "returned a list"),
    (lambda t: t.sum(), "returned shape ()"),
    (lambda t: t[None, None], "returned shape (1, 1, 2, 6,"),
    (lambda t: torch.cat([t, t[..., :1]], -1), "returned shape (2, 6,"),
    (lambda t: t[:1], "returned shape (1, 6,"),                          # item 17: was (1, T, V) logits
    (lambda t: t[0, 0], "returned shape ("),                              # item 17: was broadcast
])
def test_a_bad_hook_return_names_the_hook(model, ret, words):
    def edit(t, name):
        return ret(t)

    with pytest.raises(InputError) as e:
        run_with_hooks(model, X, [(POINT, edit)])
    assert words in str(e.value) and f"'edit' on '{POINT}'" in str(e.value), str(e.value)
    assert model.hooks is None


def test_fwd_hooks_as_a_dict_or_not_pairs(model):
    for hooks, words in (({POINT: lambda t, n: None}, "fwd_hooks is a dict"),
                         ([(POINT,)], "must be a pair (name, fn)"), ([(POINT, "not a function")], "pair (name, fn)")):
        for run in (run_with_hooks, lambda m, x, h: run_with_cache(m, x, fwd_hooks=h)):
            with pytest.raises(InputError, match=words.replace("(", r"\(").replace(")", r"\)")):
                run(model, X, hooks)


@pytest.mark.parametrize("ids, words", [
    (X[0], "two dimensions (B, T); got shape (6,) (one prompt: ids[None]"),
    (X.float(), "integer token ids"),
    (X[None], "got shape (1, 2, 6)"),
    (X + V, f"outside this model's vocabulary [0, {V})"),
])
def test_ids_that_are_not_a_batch_of_tokens(model, ids, words):
    for run in (lambda: run_with_hooks(model, ids), lambda: run_with_cache(model, ids)):
        with pytest.raises(InputError) as e:
            run()
        assert words in str(e.value), str(e.value)


def test_cache_layer_keys(model):
    _, cache = run_with_cache(model, X)
    L = len(model.blocks)
    assert torch.equal(cache["resid_pre", -1], cache[f"blocks.{L - 1}.hook_resid_pre"])    # Python's counting
    for layer, words in ((L + 3, f"layer {L + 3} is out of range"), (-L - 1, "out of range"),
                         ("1", "must be an integer, got '1'"), (1.0, "must be an integer"), (True, "integer")):
        with pytest.raises(InputError, match=words):
            cache["resid_pre", layer]


def test_ablate_heads_refuses_heads_and_layers_it_does_not_have(model):
    nh, L = model.config.n_heads, len(model.blocks)
    for heads, words in (({0: [nh + 5]}, f"head(s) [{nh + 5}]"), ({0: [-1]}, "head(s) [-1]"),
                         ({L: [0]}, f"layer {L}"), ({0: 1}, "list of head indices"), ([0, 1], "must be a dict")):
        with pytest.raises(InputError) as e:
            ablate_heads(model, X, heads)
        assert words in str(e.value), str(e.value)
    assert ablate_heads(model, X, {0: [nh - 1]}).shape == (2, 6, V)


def test_a_metric_per_prompt_is_refused_naming_the_run(model):
    per_prompt = lambda logits: logits[:, -1, 0]                          # (B,): not one number
    for run in (lambda: patch_residual(model, X, X.flip(0), per_prompt),
                lambda: patch_heads(model, X, X.flip(0), per_prompt),
                lambda: head_ablation_effects(model, X, per_prompt)):
        with pytest.raises(InputError, match=r"returned a tensor of shape \(2,\) for .*\.mean\(\)"):
            run()
    one = patch_residual(model, X[:, :3], X.flip(0)[:, :3], lambda logits: float(logits[:, -1, 0].mean()))
    assert one.shape == (len(model.blocks), 3)


def test_fit_tuned_lens_needs_a_batch(model):
    with pytest.raises(InputError, match="at least one batch"):
        fit_tuned_lens(model, [])
    with pytest.raises(InputError, match="two dimensions"):
        fit_tuned_lens(model, [X[0]], steps=1)
