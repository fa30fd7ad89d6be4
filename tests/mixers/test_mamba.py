"""Mamba: the scans against the step-by-step definition and mambapy's parallel scan (1e-5), the
mixer against transformers' MambaMixer (1e-5), recurrent steps and left padding exact against the full
forward, the LTI ablation, config checks, parameters / FLOPs / state bytes against the built layer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tformer.config import TransformerConfig
from tformer.models import build_model
from tformer.errors import ConfigError
from tformer.mixers.base import Step
from tformer.mixers.mamba import MambaMixer
from tformer.ops.scan import METHODS, SCANS, selective_scan, selective_scan_reference

pytestmark = pytest.mark.usefixtures("one_thread")


def scan_inputs(batch=2, T=37, E=8, N=4, lti=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, T, E, generator=g)
    delta = F.softplus(torch.randn(batch, T, E, generator=g))
    A = -torch.rand(E, N, generator=g) * 4
    if lti:
        return x, delta[0, 0], A, torch.randn(E, N, generator=g), torch.randn(E, N, generator=g), torch.randn(E)
    return x, delta, A, torch.randn(batch, T, N, generator=g), torch.randn(batch, T, N, generator=g), torch.randn(E)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("lti", [False, True])
def test_scans_agree_with_the_sequential_definition(method, lti):
    x, delta, A, B, C, D = scan_inputs(lti=lti)
    h0 = torch.randn(2, 8, 4)
    for start in (None, h0):
        y_ref, h_ref = selective_scan_reference(x, delta, A, B, C, D, start)
        y, h = selective_scan(x, delta, A, B, C, D, start, method=method)
        tol = 1e-4 if method == "logspace" else 1e-5  # logspace subtracts two exponentials
        torch.testing.assert_close(y, y_ref, atol=tol, rtol=tol)
        torch.testing.assert_close(h, h_ref, atol=tol, rtol=tol)


def test_reference_scan_equals_mambapy():
    mambapy = pytest.importorskip("mambapy.mamba")
    x, delta, A, B, C, D = scan_inputs(T=40)
    theirs = mambapy.MambaBlock.selective_scan(None, x, delta, A, B, C, D)  # Blelloch pscan, padded to 64
    torch.testing.assert_close(selective_scan_reference(x, delta, A, B, C, D)[0], theirs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(selective_scan(x, delta, A, B, C, D)[0], theirs, atol=1e-5, rtol=1e-5)


def test_scan_gradients_agree():
    x, delta, A, B, C, D = scan_inputs(T=20)
    grads = {}
    for method in ("reference", *METHODS):
        xx = x.clone().requires_grad_()
        fn = selective_scan_reference if method == "reference" else \
            lambda *a: selective_scan(*a, method=method)
        fn(xx, delta, A, B, C, D)[0].square().sum().backward()
        grads[method] = xx.grad
    for method in METHODS:
        torch.testing.assert_close(grads[method], grads["reference"], atol=1e-4, rtol=1e-4)


def test_loop_scan_backward_against_finite_differences():
    g = torch.Generator().manual_seed(1)
    a = torch.rand(2, 6, 3, 2, generator=g, dtype=torch.float64).requires_grad_()
    b = torch.randn(2, 6, 3, 2, generator=g, dtype=torch.float64).requires_grad_()
    h0 = torch.randn(2, 3, 2, generator=g, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(SCANS["loop"], (a, b, h0))
    assert torch.autograd.gradcheck(lambda a, b: SCANS["loop"](a, b), (a, b))


@pytest.mark.parametrize("lti", [False, True])
def test_fused_scan_backward_against_finite_differences(lti):
    from tformer.ops.scan_fused import selective_scan_fused
    x, delta, A, B, C, D = (t.double().requires_grad_() for t in scan_inputs(2, 5, 3, 2, lti=lti, seed=2))
    h0 = torch.randn(2, 3, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(selective_scan_fused, (x, delta, A, B, C, D, h0))
    assert torch.autograd.gradcheck(lambda *a: selective_scan_fused(*a)[0], (x, delta, A, B, C, D))


def mamba_config(d=32, n_layers=2, vocab=50, **options) -> TransformerConfig:
    return TransformerConfig(vocab_size=vocab, d_model=d, n_layers=n_layers, n_heads=1, mixer="mamba",
                             positions="none", norm="rmsnorm", bias=False, mixer_options={"mamba": options})


def hf_mixer_pair(d=32, d_state=8, expand=2, d_conv=3, dt_rank="auto", seed=0):
    """A random HF MambaMixer and ours holding the same weights."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.mamba.modeling_mamba import MambaMixer as HFMixer
    torch.manual_seed(seed)
    hc = transformers.MambaConfig(hidden_size=d, state_size=d_state, expand=expand, conv_kernel=d_conv,
                                  time_step_rank=dt_rank, num_hidden_layers=1)
    hf = HFMixer(hc, layer_idx=0).eval()
    ours = MambaMixer(mamba_config(d, d_state=d_state, expand=expand, d_conv=d_conv, dt_rank=dt_rank))
    state = {k.replace("dt_proj.bias", "dt_bias"): v for k, v in hf.state_dict().items()}
    ours.load_state_dict(state, strict=True)
    return hf, ours.eval()


@pytest.mark.parametrize("shape", [dict(), dict(d_state=4, expand=1, d_conv=4, dt_rank=5),
                                   dict(d_state=16, expand=3, d_conv=2, dt_rank=1)])
def test_mixer_equals_transformers(shape):
    hf, ours = hf_mixer_pair(**shape)
    x = torch.randn(3, 11, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(x, Step(positions=torch.arange(11))), hf(x), atol=1e-5, rtol=1e-5)


def test_recurrent_steps_equal_the_full_forward():
    torch.manual_seed(0)
    mixer = MambaMixer(mamba_config(d_conv=4)).eval()
    x = torch.randn(2, 12, 32)
    with torch.no_grad():
        full = mixer(x)
        state = mixer.new_state(2, 0)
        parts = [mixer(x[:, :5], Step(positions=torch.arange(5)), state)]                  # prefill 5
        parts += [mixer(x[:, t:t + 1], Step(positions=torch.tensor([t])), state) for t in range(5, 12)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)


def test_left_padding_changes_nothing():
    torch.manual_seed(0)
    mixer = MambaMixer(mamba_config(d_conv=4)).eval()
    mixer.in_proj.bias = torch.nn.Parameter(torch.randn(128))  # padding must be zeroed after in_proj's bias
    x = torch.randn(1, 6, 32)
    padded = torch.cat([torch.randn(1, 3, 32), x], dim=1)
    tokens = torch.tensor([[False] * 3 + [True] * 6])
    with torch.no_grad():
        alone = mixer(x)
        s1, s2 = mixer.new_state(1), mixer.new_state(1)
        mixer(x, Step(positions=torch.arange(6)), s1)
        out = mixer(padded, Step(positions=torch.arange(9), tokens=tokens), s2)
    torch.testing.assert_close(out[:, 3:], alone, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(s2.ssm, s1.ssm, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(s2.conv, s1.conv, atol=1e-6, rtol=1e-6)


def test_lti_ablation_does_not_depend_on_the_input():
    torch.manual_seed(0)
    selective = MambaMixer(mamba_config(selective=True))
    lti = MambaMixer(mamba_config(selective=False))
    u1, u2 = torch.randn(1, 5, 64), torch.randn(1, 5, 64)
    for a, b in zip(lti._ssm_parameters(u1), lti._ssm_parameters(u2)):
        assert torch.equal(a, b)
    assert not torch.allclose(selective._ssm_parameters(u1)[0], selective._ssm_parameters(u2)[0])
    # With Δ, B, C fixed the SSM is a linear map of its input (a convolution); selective is not linear.
    def ssm(mixer, u):
        delta, B, C = mixer._ssm_parameters(u)
        return selective_scan(u, delta, -torch.exp(mixer.A_log), B, C, mixer.D)[0]

    with torch.no_grad():
        torch.testing.assert_close(ssm(lti, u1 + u2), ssm(lti, u1) + ssm(lti, u2), atol=1e-5, rtol=1e-5)
        assert not torch.allclose(ssm(selective, u1 + u2), ssm(selective, u1) + ssm(selective, u2), atol=1e-2)


@pytest.mark.parametrize("options", [dict(), dict(selective=False, conv_bias=False, d_conv=1),
                                     dict(d_state=4, expand=3, dt_rank=7)])
def test_parameters_flops_and_state_bytes_from_the_config(options):
    from torch.utils.flop_counter import FlopCounterMode
    for bias in (False, True):
        config = TransformerConfig(d_model=32, n_heads=1, mixer="mamba", bias=bias, mixer_options={"mamba": options})
        mixer = MambaMixer(config)
        assert MambaMixer.count_parameters(config) == sum(p.numel() for p in mixer.parameters())
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            mixer(torch.randn(2, 10, 32))
        assert counter.get_total_flops() == 2 * 10 * MambaMixer.matmul_flops_per_token(config)
        state = mixer.new_state(3, 1000)
        assert state.nbytes == MambaMixer.state_bytes(config, 1000, 3, 4) == MambaMixer.state_bytes(config, 10, 3, 4)


@pytest.mark.parametrize("bad", [dict(d_state=0), dict(expand=1.5), dict(dt_rank="big"), dict(selective="yes"),
                                 dict(scan="fft"), dict(dstate=4)])
def test_bad_options_are_refused_in_one_sentence(bad):
    with pytest.raises(ConfigError, match="mixer_options"):
        build_model(TransformerConfig(d_model=32, n_heads=1, mixer="mamba", mixer_options={"mamba": bad}))


def test_the_model_keeps_mambas_own_initialisation():
    from tformer.models import build_model
    c = mamba_config(d=32, d_state=8)
    c.ffn = "none"
    model = build_model(c)
    for block in model.blocks:
        m = block.attn
        dt = F.softplus(m.dt_bias)
        assert dt.min() >= 1e-3 * 0.999 and dt.max() <= 0.1 * 1.001            # not zeroed by the generic init
        assert m.dt_proj.weight.abs().max() <= m.shape.R ** -0.5 and m.dt_proj.weight.std() > 0.1
        torch.testing.assert_close(-torch.exp(m.A_log[0]), -torch.arange(1.0, 9.0))
        assert torch.equal(m.D, torch.ones_like(m.D))
