"""ReLU² and logit soft-capping against NumPy references, values and gradients."""

import numpy as np
import pytest
import torch

from tformer import DecoderLM, TransformerConfig
from tformer.errors import ConfigError
from tformer.nn.feed_forward import ACTIVATIONS, relu_squared
from tformer.nn.softcap import softcap


def test_relu_squared_matches_numpy_and_its_gradient_is_two_relu():
    x = torch.linspace(-3, 3, 101, dtype=torch.float64, requires_grad=True)
    y = relu_squared(x)
    ref = np.maximum(x.detach().numpy(), 0.0) ** 2
    assert np.allclose(y.detach().numpy(), ref, rtol=0, atol=1e-12)
    y.sum().backward()
    assert np.allclose(x.grad.numpy(), 2 * np.maximum(x.detach().numpy(), 0.0), rtol=0, atol=1e-12)
    assert ACTIVATIONS["relu2"](x).equal(y)


def test_softcap_is_cap_tanh_bounded_and_identity_near_zero():
    z = torch.linspace(-200, 200, 401, dtype=torch.float64, requires_grad=True)
    out = softcap(z, 15.0)
    assert np.allclose(out.detach().numpy(), 15.0 * np.tanh(z.detach().numpy() / 15.0), rtol=0, atol=1e-12)
    assert out.abs().max() < 15.0
    out.sum().backward()                                            # d/dz = 1 - tanh²(z / cap)
    assert np.allclose(z.grad.numpy(), 1 - np.tanh(z.detach().numpy() / 15.0) ** 2, rtol=0, atol=1e-12)
    small = torch.tensor([1e-3, -2e-3], dtype=torch.float64)
    assert torch.allclose(softcap(small, 15.0), small, rtol=1e-8)   # tanh(u) = u - u³/3: identity near 0
    assert softcap(z, 0.0) is z


def test_decoder_logits_are_the_uncapped_logits_soft_capped():
    """The same weights with and without logit_softcap=3: capped = 3·tanh(uncapped / 3)."""
    base = dict(vocab_size=17, context_length=8, n_layers=1, d_model=16, n_heads=2)
    torch.manual_seed(0)
    plain = DecoderLM(TransformerConfig(**base)).eval()
    capped = DecoderLM(TransformerConfig(**base, logit_softcap=3.0)).eval()
    with torch.no_grad():
        plain.lm_head.weight.mul_(40)                               # logits well past the cap
    capped.load_state_dict(plain.state_dict())
    ids = torch.randint(0, 17, (2, 8))
    raw, capd = plain(ids)[0], capped(ids)[0]
    assert raw.abs().max() > 6
    assert torch.allclose(capd, 3.0 * torch.tanh(raw / 3.0), atol=1e-5)


def test_zero_init_residual_makes_every_block_the_identity():
    """Zero out_proj / down weights: the stream after the blocks is the embedding sum itself."""
    torch.manual_seed(0)
    m = DecoderLM(TransformerConfig(vocab_size=17, context_length=8, n_layers=3, d_model=16, n_heads=2,
                                    zero_init_residual=True, bias=False)).eval()
    for b in m.blocks:
        assert b.attn.out_proj.weight.abs().max() == 0 and b.ffn.down.weight.abs().max() == 0
        assert b.attn.qkv_proj.weight.abs().max() > 0                # the rest keeps its init
    ids = torch.randint(0, 17, (2, 8))
    emb = m.tok_emb(ids) + m.pos_emb(torch.arange(8))
    assert torch.allclose(m.hidden_states(ids), emb, atol=1e-6)


@pytest.mark.parametrize("bad", [dict(logit_softcap=-1.0), dict(logit_softcap=float("nan")),
                                 dict(qk_norm="yes"), dict(activation="relu3")])
def test_recipe_switches_are_validated(bad):
    with pytest.raises(ConfigError):
        TransformerConfig(**bad)


def test_relu_squared_gradient_in_float64_and_under_bf16_autocast():
    """The hand-written backward (tformer.nn.feed_forward._ReLUSquared) against autograd's numerical
    gradient in float64, and under bf16 autocast against the plain expression's own autograd."""
    x = torch.randn(64, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(relu_squared, (x,))
    a = torch.randn(8, 32, requires_grad=True)
    b = a.detach().clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ya = relu_squared(a.bfloat16())
        yb = torch.nn.functional.relu(b.bfloat16()).square()
    assert ya.dtype == yb.dtype == torch.bfloat16 and torch.equal(ya, yb)
    ya.float().sum().backward()
    yb.float().sum().backward()
    assert torch.equal(a.grad, b.grad)
