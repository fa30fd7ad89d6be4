"""Longformer and BigBird kernels against dense attention under the explicit mask of the same pattern.

Reference: tformer's math backend (itself held equal to PyTorch's fused kernel in test_attention.py)
given the dense (n, n) mask; fp64, tolerance 1e-10 on outputs and on gradients of q, k, v.
"""

import pytest
import torch

from tformer.ops.bigbird import bigbird_attention, bigbird_mask, dense_reason, random_blocks
from tformer.ops.sdpa import scaled_dot_product_attention as sdpa
from tformer.ops.longformer import longformer_attention, longformer_mask

TOL = 1e-10


def _rand(*shape, n=3):
    return [torch.randn(*shape, dtype=torch.float64, requires_grad=True) for _ in range(n)]


def _grads(out, ref, inputs):
    g = torch.randn_like(out)
    ga = torch.autograd.grad((out * g).sum(), inputs, allow_unused=True)
    gb = torch.autograd.grad((ref * g).sum(), inputs, allow_unused=True)
    return max((a - b).abs().max().item() for a, b in zip(ga, gb))


def _longformer_reference(q, k, v, qg, kg, vg, window, causal, dilation, key_mask, global_mask):
    B, _, n, _ = q.shape
    local = longformer_mask(n, window, causal=causal, dilation=dilation, global_mask=global_mask) & key_mask[:, None]
    ref = sdpa(q, k, v, mask=local[:, None], backend="math")                    # non-global rows
    every = key_mask[:, None, :].expand(B, n, n)
    if causal:
        every = every & torch.ones(n, n, dtype=torch.bool).tril()
    ref_g = sdpa(qg, kg, vg, mask=every[:, None], backend="math")               # global rows: all keys
    return torch.where(global_mask[:, None, :, None], ref_g, ref)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window,dilation", [(1, 1), (4, 1), (5, 1), (3, 2), (4, 3)])
def test_longformer_equals_dense_under_its_mask(causal, window, dilation):
    torch.manual_seed(window * 10 + dilation + causal)
    B, H, n, e = 2, 2, 29, 8
    q, k, v, qg, kg, vg = _rand(B, H, n, e, n=6)
    key_mask = torch.rand(B, n) > 0.15
    global_mask = torch.zeros(B, n, dtype=torch.bool)
    global_mask[0, [0, 7, 20]] = True
    global_mask[1, 3] = True
    out = longformer_attention(q, k, v, window, causal=causal, dilation=dilation, key_mask=key_mask,
                               global_mask=global_mask, global_qkv=(qg, kg, vg))
    ref = _longformer_reference(q, k, v, qg, kg, vg, window, causal, dilation, key_mask, global_mask)
    assert (out - ref).abs().max().item() < TOL
    assert _grads(out, ref, (q, k, v, qg, kg, vg)) < TOL


def test_longformer_without_globals_is_the_sliding_window_of_tformer():
    """Same pattern as tformer's own ``window=`` argument (masks.sliding_window_mask), both directions."""
    q, k, v = _rand(1, 2, 40, 8)
    for causal in (False, True):
        out = longformer_attention(q, k, v, 6, causal=causal)
        ref = sdpa(q, k, v, causal=causal, window=6, backend="math")
        assert (out - ref).abs().max().item() < TOL


def test_longformer_memory_is_linear_in_the_window():
    """The largest tensor in the computation is O(n·w): the scores are (B, H, n/w, w, 3w - 2)."""
    q, k, v = (torch.randn(1, 1, 1024, 8) for _ in range(3))
    seen = []

    class Spy(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor):
                seen.append(out.numel())
            return out

    with Spy():
        longformer_attention(q, k, v, 16)
    assert max(seen) <= 1024 * (3 * 16 - 2)                  # never 1024² elements
    assert max(seen) < 1024 * 1024 / 10


@pytest.mark.parametrize("n_blocks,n_random", [(9, 2), (12, 3), (8, 1)])
def test_bigbird_equals_dense_under_its_mask(n_blocks, n_random):
    torch.manual_seed(n_blocks)
    B, H, b, e = 2, 3, 4, 8
    n = n_blocks * b
    q, k, v = _rand(B, H, n, e)
    table = random_blocks(n_blocks, n_random, H, seed=7)
    key_mask = torch.rand(B, n) > 0.1
    out = bigbird_attention(q, k, v, b, table, key_mask=key_mask)
    mask = bigbird_mask(n, b, table)[None] & key_mask[:, None, None, :]
    ref = sdpa(q, k, v, mask=mask, backend="math")
    assert (out - ref).abs().max().item() < TOL
    assert _grads(out, ref, (q, k, v)) < TOL


def test_bigbird_random_blocks_are_seeded_distinct_and_outside_the_window():
    a, b = random_blocks(16, 3, 4, seed=3), random_blocks(16, 3, 4, seed=3)
    assert torch.equal(a, b) and not torch.equal(a, random_blocks(16, 3, 4, seed=4))
    for h in range(4):
        for i in range(1, 15):
            row = set(a[h, i].tolist())
            assert len(row) == 3 and not row & {0, 15, i - 1, i, i + 1}


def test_bigbird_dense_fallback_has_a_reason():
    assert "dense" in dense_reason(9 * 64, 64, 3)             # 576 <= (5 + 6)·64
    assert dense_reason(12 * 64, 64, 3) is None
