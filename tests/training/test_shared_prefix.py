"""The shared prefix run once per batch (:mod:`tformer.training.shared_prefix`) gives the loss and the
gradients of the plain forward, full model and LoRA: the loss to 1e-12 (float64) / 1e-6 (fp32)
relative, each gradient within 1e-7 (float64) / 1e-5 (fp32) of its largest entry (measured: 3e-8 and
5e-7; the weights' gradients are summed in another order, and the norms and the loss compute in fp32
even for float64 weights, hence no 1e-15); it is refused where it would not be exact."""

from __future__ import annotations

import pytest
import torch

from finetune_fixtures import with_active_lora
from tformer.config import TransformerConfig
from tformer.models import build_model
from tformer.training.chat_data import IGNORE
from tformer.training.lora import LoRASpec, add_lora
from tformer.training import shared_prefix
from tformer.training.shared_prefix import can_share, prefix_shared_loss, shared_prefix_length


def tiny(seed: int = 0, **kw):
    torch.manual_seed(seed)
    c = TransformerConfig(**{**dict(vocab_size=97, context_length=48, n_layers=3, d_model=32, n_heads=4, n_kv_heads=2,
                                    norm="rmsnorm", positions="rope", ffn="swiglu", bias=False, tie_embeddings=True),
                             **kw})
    return build_model(c)


def chat_batch(B: int = 4, P: int = 11, T: int = 24, seed: int = 1):
    """Rows that share their first ``P`` tokens (a system prompt), labelled answers after a question,
    right padding of different lengths."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 97, (B, T), generator=g)
    ids[:, :P] = torch.randint(0, 97, (P,), generator=g)
    ids[:, P] = torch.arange(1, B + 1)                                  # the rows part at position P
    targets = torch.full((B, T), IGNORE)
    for r in range(B):
        end = T - 2 * r                                                # rows end at different lengths: padding after
        targets[r, P + 4:end - 1] = ids[r, P + 5:end]
        ids[r, end:] = 0
    return ids, targets


@pytest.fixture
def layers_shared(monkeypatch):
    """Counts the layers that read the shared prefix (so a test cannot pass on the plain fallback)."""
    calls = []
    store = shared_prefix._SharedPrefix.store
    monkeypatch.setattr(shared_prefix._SharedPrefix, "store", lambda self, *a: calls.append(1) or store(self, *a))
    return calls


def loss_and_grads(model, fn):
    loss = fn()
    loss.backward()
    g = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), g


def test_prefix_length_stops_at_the_first_difference_and_the_first_target():
    ids, targets = chat_batch(P=11)
    assert shared_prefix_length(ids, targets) == 11
    targets[2, 7] = 5                                                   # a target inside the common tokens
    assert shared_prefix_length(ids, targets) == 7
    same = ids[:1].repeat(3, 1)
    assert shared_prefix_length(same, torch.full_like(same, IGNORE)) == same.shape[1] - 1   # one left for the rest


@pytest.mark.parametrize("dtype,loss_rtol,grad_rtol", [(torch.float64, 1e-12, 1e-7), (torch.float32, 1e-6, 1e-5)])
@pytest.mark.parametrize("lora", [False, True])
def test_shared_prefix_gives_the_plain_loss_and_gradients(lora, dtype, loss_rtol, grad_rtol, layers_shared):
    model = tiny().to(dtype)
    if lora:
        with_active_lora(model)
    ids, targets = chat_batch()
    assert shared_prefix_length(ids, targets) == 11 and can_share(model)
    plain, g_plain = loss_and_grads(model, lambda: model(ids, targets, labelled_only=True)[1])
    shared, g_shared = loss_and_grads(model, lambda: prefix_shared_loss(model, ids, targets))
    assert len(layers_shared) == 3                                      # every layer read the one prefix
    assert torch.allclose(shared, plain, rtol=loss_rtol, atol=0)
    assert g_plain.keys() == g_shared.keys() and len(g_plain) >= 3
    for k in g_plain:
        scale = g_plain[k].abs().max()
        assert scale > 0, k
        assert (g_shared[k] - g_plain[k]).abs().max() <= grad_rtol * scale, k


@pytest.mark.parametrize("kw", [dict(sliding_window=6), dict(positions="alibi"), dict(positions="learned")])
def test_window_alibi_and_learned_positions_give_the_plain_loss(kw, layers_shared):
    model = tiny(**kw).double()
    ids, targets = chat_batch()
    plain = model(ids, targets, labelled_only=True)[1]
    assert torch.allclose(prefix_shared_loss(model, ids, targets), plain, rtol=1e-12, atol=0)
    assert len(layers_shared) == 3


def test_a_prefix_longer_than_the_rest_several_times_over_is_run_plainly(layers_shared):
    model = tiny().double()
    ids, targets = chat_batch(B=2, P=20, T=24)                          # (B+1)·20 positions > 0.9·B·24
    targets[0, 21] = 5                                                  # one labelled token after the prefix
    assert shared_prefix_length(ids, targets) == 20
    plain = model(ids, targets, labelled_only=True)[1]
    assert torch.equal(prefix_shared_loss(model, ids, targets), plain) and not layers_shared


def test_refused_where_not_exact():
    assert not can_share(tiny(dropout=0.1))                            # rows would share the prefix's dropout masks
    model = tiny()
    add_lora(model, LoRASpec(r=2, alpha=4, dropout=0.1))
    assert not can_share(model)
    assert can_share(tiny())
