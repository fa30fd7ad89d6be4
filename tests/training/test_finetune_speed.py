"""The fine-tuning step's shortcuts change no number: the LM head run at labelled positions only
gives the full head's loss and gradients, and the LoRA layer's one-matmul update (a block ``B``)
gives the per-slice reference ``y[s:e] += scale · dropout(x) A^T B^T`` and its gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from finetune_fixtures import with_active_lora
from tformer.config import TransformerConfig
from tformer.models import build_model
from tformer.training.chat_data import IGNORE
from tformer.training.lora import LoRALinear, LoRASpec, add_lora
from tformer.training.tasks.finetune import FinetuneTask


def tiny_decoder(seed: int = 0):
    torch.manual_seed(seed)
    c = TransformerConfig(vocab_size=97, context_length=32, n_layers=2, d_model=32, n_heads=4, n_kv_heads=2,
                          norm="rmsnorm", positions="rope", ffn="swiglu", bias=False, tie_embeddings=True)
    return build_model(c).double()


def batch(B: int = 3, T: int = 13, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 97, (B, T), generator=g)
    targets = torch.randint(0, 97, (B, T), generator=g)
    targets[torch.rand(B, T, generator=g) < 0.7] = IGNORE          # most positions unlabelled, as in chat data
    targets[-1, 5:] = IGNORE                                         # a row padded at the end
    return ids, targets


def grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("lora", [False, True])
def test_head_on_labelled_positions_equals_the_full_head(lora):
    model = tiny_decoder()
    if lora:
        with_active_lora(model)
    ids, targets = batch()
    full = model(ids, targets)[1]
    full.backward()
    g_full = grads(model)
    logits, short = model(ids, targets, labelled_only=True)
    short.backward()
    g_short = grads(model)
    n = int((targets != IGNORE).sum())
    assert logits.shape == (1, n, 97)
    assert torch.allclose(short, full, rtol=1e-12, atol=0)            # float64: the same sum, reordered at most
    assert g_short.keys() == g_full.keys() and g_full
    for k in g_full:
        assert torch.allclose(g_short[k], g_full[k], rtol=1e-10, atol=1e-14), k
    # an independent reference: the full logits' cross-entropy over the labelled positions, by hand in
    # float64 (the model's loss is taken in fp32 by design: token_loss)
    with torch.no_grad():
        ref = model(ids)[0]
    keep = targets != IGNORE
    by_hand = -(ref[keep].log_softmax(-1).gather(1, targets[keep][:, None])).mean()
    assert abs(short.item() - by_hand.item()) <= 1e-6 * by_hand.item()


def test_head_on_labelled_positions_in_fp32_is_within_1e_6():
    model = tiny_decoder().float()
    ids, targets = batch(B=4, T=20, seed=3)
    full, short = model(ids, targets)[1], model(ids, targets, labelled_only=True)[1]
    assert abs(float(short) - float(full)) <= 1e-6 * abs(float(full))


def test_finetune_task_uses_the_short_head_and_gets_the_same_loss():
    model = tiny_decoder()
    examples = [(list(range(1, 9 + k)), [IGNORE] * 5 + list(range(6, 9 + k))) for k in range(4)]

    class Cfg:
        batch_size, seed, eval_batches = 3, 0, 1

    class Tok:
        def decode(self, ids):
            return ""

    calls = []

    def forward(*args, **kw):
        calls.append(kw)
        return model(*args, **kw)

    short = FinetuneTask(examples, [], Cfg, Tok(), 0, labelled_only=True)
    plain = FinetuneTask(examples, [], Cfg, Tok(), 0)
    b = short.batch(0)
    assert torch.allclose(short.loss(forward, b), plain.loss(forward, b), rtol=1e-12, atol=0)
    assert calls == [{"labelled_only": True}, {}]


def reference_lora(layer: LoRALinear, x: torch.Tensor) -> torch.Tensor:
    """PEFT's arithmetic, slice by slice: ``y[..., s:e] += scale · (dropout(x) A^T) B^T``."""
    y = F.linear(x, layer.weight, layer.bias).clone()
    for n, (s, e) in layer.slices.items():
        y[..., s:e] = y[..., s:e] + layer.scale * (layer.dropout(x) @ layer.lora_A[n].T) @ layer.lora_B[n].T
    return y


@pytest.mark.parametrize("slices", [{"q_proj": (0, 8), "v_proj": (12, 16)},      # fused qkv, k left out
                                    {"k_proj": (8, 12)},                          # one slice inside
                                    {"q_proj": (0, 8), "k_proj": (8, 12), "v_proj": (12, 16)},
                                    {"down_proj": (0, 16)}])
def test_one_matmul_lora_equals_the_per_slice_reference(slices):
    torch.manual_seed(0)
    base = nn.Linear(6, 16, bias=True).double()
    layer = LoRALinear(base, slices, LoRASpec(r=3, alpha=5.0))          # scale 5/3: not a power of two
    for p in layer.lora_B.values():
        nn.init.normal_(p)
    x = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)
    got, want = layer(x), reference_lora(layer, x)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    dy = torch.randn_like(got)
    g_got = torch.autograd.grad(got, [x, *layer.lora_A.values(), *layer.lora_B.values()], dy)
    g_want = torch.autograd.grad(want, [x, *layer.lora_A.values(), *layer.lora_B.values()], dy)
    for a, b in zip(g_got, g_want):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    assert layer.weight.grad is None and not layer.weight.requires_grad   # the frozen base gets no dW


def test_a_frozen_weights_cached_cast_is_what_autocast_computes():
    from tformer.training.frozen_cast import FrozenCastLinear, cache_frozen_casts
    torch.manual_seed(0)
    plain = nn.Linear(24, 40)
    plain.requires_grad_(False)
    cached = cache_frozen_casts(nn.Sequential(nn.Linear(24, 40)))[0]
    assert type(cached) is FrozenCastLinear
    cached.load_state_dict(plain.state_dict())
    cached.requires_grad_(False)
    x = torch.randn(3, 7, 24, requires_grad=True)
    for _ in range(2):                                              # the second call reads the cache
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want, got = plain(x), cached(x)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)
        dy = torch.randn_like(want.float()).to(want.dtype)
        assert torch.equal(torch.autograd.grad(got, x, dy)[0], torch.autograd.grad(want, x, dy)[0])
    first = cached._frozen_cast[1]
    with torch.no_grad():
        plain.weight.add_(1.0)
        cached.weight.add_(1.0)                                     # new values: the cast is made again
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(cached(x), plain(x)) and cached._frozen_cast[1] is not first
    assert torch.equal(cached(x), plain(x))                         # no autocast: fp32, no cast
    cached.weight.requires_grad_(True)                              # trained (full fine-tuning): autocast's own path
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = cached(x)
    out.float().sum().backward()
    assert cached.weight.grad is not None and cached.weight.grad.shape == cached.weight.shape


def test_lora_keeps_the_tied_head_and_the_state_dict_keys():
    model = tiny_decoder().float()
    keys = set(model.state_dict())
    add_lora(model, LoRASpec(r=2, alpha=4))
    assert model.lm_head.weight is model.tok_emb.weight
    assert {k for k in model.state_dict() if "lora_" not in k} == keys
