"""Performer (FAVOR+) and Linformer kernels against exact softmax attention and the reference packages.

References: exact attention written out here (softmax of QKᵀ/sqrt(d)); ``performer-pytorch``'s
``FastAttention`` and ``linformer``'s ``LinformerSelfAttention`` (dev dependencies), given the same
projection matrices / weights; tolerance 1e-5 in fp32.
"""

import functools
import math

import pytest
import torch

from tformer.ops.linformer import linformer_attention
from tformer.ops.performer import favor_attention, favor_causal, gaussian_orthogonal, softmax_features


def _exact_kernel(q, k):
    return torch.exp(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]))


def _exact(q, k, v, causal=False):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(s, -1) @ v


def _draws(q, k, m, draws, orthogonal=True, seed=0):
    """φ(Q)φ(K)ᵀ, without a stabiliser (the plain unbiased estimator), for ``draws`` projections: ``(draws, n, n)``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(draws):
        w = gaussian_orthogonal(m, q.shape[-1], orthogonal=orthogonal, generator=g, dtype=torch.float64)
        qf = softmax_features(q, w, is_query=True, stabilizer="none")
        kf = softmax_features(k, w, is_query=False, stabilizer="none")
        out.append(qf @ kf.T)
    return torch.stack(out)


def _qk(n=12, d=16, seed=0, spread=0.3):
    g = torch.Generator().manual_seed(seed)
    return [spread * torch.randn(n, d, generator=g, dtype=torch.float64) for _ in range(2)]


def test_kernel_estimate_is_unbiased_and_error_falls_as_one_over_sqrt_draws():
    """φ(q)·φ(k) estimates exp(q·k/sqrt(d)) without bias: the error of the mean over N draws keeps
    falling like N^-1/2 (16x the draws: ideally 1/4 of the error). A biased estimator stalls at its
    bias (the orthogonal draw without the sign fix of the QR factor did, at ~0.02)."""
    q, k = _qk()
    exact = _exact_kernel(q, k)
    est = _draws(q, k, m=16, draws=1600)
    err = [(est[:n].mean(0) - exact).abs().mean().item() for n in (100, 1600)]
    assert err[1] < 0.45 * err[0]
    assert err[1] < 0.01


def test_attention_mean_over_draws_converges_to_softmax_attention():
    """The normalised attention (a ratio of two unbiased estimates, O(1/m) bias) averaged over draws
    is much closer to softmax attention than one draw is."""
    q, k = _qk(seed=1, spread=0.5)
    v = torch.randn(12, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    exact = _exact(q, k, v)
    g = torch.Generator().manual_seed(3)

    def one(m):
        w = gaussian_orthogonal(m, 16, generator=g, dtype=torch.float64)
        return favor_attention(softmax_features(q, w, is_query=True), softmax_features(k, w, is_query=False), v)

    mean = torch.stack([one(64) for _ in range(400)]).mean(0)
    single = (one(64) - exact).abs().mean().item()
    assert (mean - exact).abs().mean().item() < 0.2 * single


def test_error_falls_with_features_and_orthogonal_beats_iid():
    q, k = _qk(seed=4)
    exact = _exact_kernel(q, k)

    @functools.lru_cache(maxsize=None)
    def mse(m, orthogonal):
        return ((_draws(q, k, m, draws=400, orthogonal=orthogonal, seed=m + orthogonal) - exact) ** 2).mean().item()

    assert mse(64, True) < 0.4 * mse(16, True)            # variance ~ 1/m: ideally 0.25
    assert mse(256, True) < 0.4 * mse(64, True)
    assert mse(16, True) < mse(16, False)                 # orthogonal features: lower variance
    assert mse(64, True) < mse(64, False)


def test_bound_and_max_stabilisers_give_the_same_attention():
    torch.manual_seed(5)
    q, k, v = (torch.randn(2, 3, 20, 16, dtype=torch.float64) for _ in range(3))
    w = gaussian_orthogonal(32, 16, dtype=torch.float64)
    a = favor_attention(softmax_features(q, w, is_query=True), softmax_features(k, w, is_query=False), v)
    b = favor_attention(softmax_features(q, w, is_query=True, stabilizer="max"),
                        softmax_features(k, w, is_query=False, stabilizer="max"), v)
    assert (a - b).abs().max().item() < 1e-10


def test_causal_prefix_sums_equal_the_masked_quadratic_form_and_the_recurrence():
    torch.manual_seed(6)
    q, k, v = (torch.randn(2, 3, 50, 16, dtype=torch.float64) for _ in range(3))
    w = gaussian_orthogonal(24, 16, dtype=torch.float64)
    qf, kf = softmax_features(q, w, is_query=True), softmax_features(k, w, is_query=False)
    a = (qf @ kf.transpose(-1, -2)).tril()                                  # (B, H, n, n), written out
    quadratic = (a @ v) / a.sum(-1, keepdim=True)
    parallel, _ = favor_causal(qf, kf, v, chunk=16)
    assert (parallel - quadratic).abs().max().item() < 1e-10
    state, steps = None, []
    for t in range(50):                                                     # one token at a time
        o, state = favor_causal(qf[:, :, t:t + 1], kf[:, :, t:t + 1], v[:, :, t:t + 1], state)
        steps.append(o)
    assert (torch.cat(steps, 2) - parallel).abs().max().item() < 1e-10
    assert state[0].shape == (2, 3, 24, 16) and state[1].shape == (2, 3, 24)   # fixed size


def test_performer_equals_performer_pytorch_fast_attention():
    pp = pytest.importorskip("performer_pytorch")
    torch.manual_seed(7)
    ref = pp.FastAttention(dim_heads=32, nb_features=48, causal=False)
    q, k, v = (torch.randn(2, 4, 100, 32) for _ in range(3))
    w = ref.projection_matrix                                               # (m, d), the same draw
    ours = favor_attention(softmax_features(q, w, is_query=True, stabilizer="max", eps=1e-4),
                           softmax_features(k, w, is_query=False, stabilizer="max", eps=1e-4), v)
    assert (ours - ref(q, k, v)).abs().max().item() < 1e-5


def test_linformer_with_identity_projections_is_dense_attention():
    torch.manual_seed(8)
    q, k, v = (torch.randn(2, 3, 20, 8, dtype=torch.float64) for _ in range(3))
    eye = torch.eye(20, dtype=torch.float64)[None]
    assert (linformer_attention(q, k, v, eye, eye) - _exact(q, k, v)).abs().max().item() < 1e-12


def test_linformer_equals_the_linformer_package():
    lp = pytest.importorskip("linformer")
    torch.manual_seed(9)
    ref = lp.LinformerSelfAttention(dim=32, seq_len=40, k=12, heads=4).eval()
    x = torch.randn(2, 30, 32)                                              # shorter than seq_len
    B, n, h, e = 2, 30, 4, 8
    split = lambda t: t.view(B, n, h, e).transpose(1, 2)                   # noqa: E731
    q, k, v = split(ref.to_q(x)), split(ref.to_k(x)), split(ref.to_v(x))
    E, F = ref.proj_k.T[None], ref.proj_v.T[None]                           # (1, k, seq_len)
    out = linformer_attention(q, k, v, E, F).transpose(1, 2).reshape(B, n, h * e)
    assert (ref.to_out(out) - ref(x)).abs().max().item() < 1e-5
