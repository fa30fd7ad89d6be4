"""Hook points: hooked runs equal plain ones, replacements take effect, and hooks never outlive a call."""

from __future__ import annotations

import pytest
import torch

from tl_reference import V, tformer_model

from tformer import DecoderLM, TransformerConfig
from tformer.errors import InputError
from tformer.interp import hook_names, run_with_cache, run_with_hooks


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_hooked_forward_equals_plain(family):
    model = tformer_model(family)
    x = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(x)[0]
        hooked, cache = run_with_cache(model, x)
    assert (hooked - plain).abs().max() <= 1e-5
    assert list(cache.keys()) == hook_names(model)                    # every point fired, in forward order
    assert model.hooks is None


def test_alibi_window_post_norm_and_recipe_switches_hooked_equal_plain():
    torch.manual_seed(0)
    for kw in (dict(positions="alibi", sliding_window=3), dict(norm_placement="post"),
               dict(qk_norm=True, activation="relu2", logit_softcap=15.0)):     # the training recipes' switches
        model = DecoderLM(TransformerConfig(vocab_size=50, n_layers=2, n_heads=2, d_model=32, context_length=16,
                                            **kw)).eval()
        x = torch.randint(0, 50, (1, 10))
        with torch.no_grad():
            assert (run_with_cache(model, x)[0] - model(x)[0]).abs().max() <= 1e-5


def test_hooked_cached_decoding_equals_plain():
    """Hooks reach the KV-cache path too: a prompt then one token, with hooks, equals the plain calls."""
    model = tformer_model("llama")
    x = torch.randint(0, V, (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain_state, hooked_state = model.new_state(1, 8), model.new_state(1, 8)
        model(x[:, :5], state=plain_state)
        plain = model(x[:, 5:], state=plain_state)[0]
        run_with_hooks(model, x[:, :5], [], state=hooked_state)
        logits, cache = run_with_cache(model, x[:, 5:], state=hooked_state)
    assert (logits - plain).abs().max() <= 1e-5
    assert cache["pattern", 0].shape == (1, 4, 1, 6)                 # one query over six keys


def test_a_replacement_changes_the_forward_as_the_weights_would():
    """Zeroing layer 1's attention output by hook equals zeroing its out_proj weight (bias kept)."""
    model = tformer_model("gpt2")
    x = torch.randint(0, V, (1, 7), generator=torch.Generator().manual_seed(2))
    bias = model.blocks[1].attn.out_proj.bias.detach().clone()
    with torch.no_grad():
        hooked = run_with_hooks(model, x, [("blocks.1.hook_attn_out", lambda t, name: torch.zeros_like(t) + bias)])
        model.blocks[1].attn.out_proj.weight.zero_()
        edited = model(x)[0]
    assert (hooked - edited).abs().max() <= 1e-5


def test_predicate_names_and_errors():
    model = tformer_model("gpt2")
    x = torch.randint(0, V, (1, 4))
    _, cache = run_with_cache(model, x, names=lambda n: n.endswith("hook_pattern"))
    assert list(cache.keys()) == ["blocks.0.attn.hook_pattern", "blocks.1.attn.hook_pattern"]
    with pytest.raises(InputError, match="no hook point named"):
        run_with_hooks(model, x, [("blocks.9.hook_resid_pre", lambda t, n: t)])
    with pytest.raises(RuntimeError):
        run_with_hooks(model, x, [("blocks.0.hook_resid_mid", lambda t, n: (_ for _ in ()).throw(RuntimeError()))])
    assert model.hooks is None                                        # restored after the error
    with pytest.raises(InputError, match="holds no"):
        cache["resid_pre", 0]
