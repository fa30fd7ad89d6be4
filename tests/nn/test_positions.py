"""Position schemes against their closed forms and defining properties."""

import math

import pytest
import torch

from tformer.nn.positions import RotaryEmbedding, sinusoidal_table
from tformer.ops.alibi import alibi_bias, alibi_slopes


def test_sinusoidal_is_the_paper_formula():
    d, L = 16, 50
    table = sinusoidal_table(L, d)
    for p in [0, 1, 7, 49]:
        for i in range(d // 2):
            angle = p / 10000 ** (2 * i / d)
            assert table[p, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert table[p, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def test_sinusoidal_shift_is_a_fixed_rotation():
    """PE(p + k) = M_k PE(p) for one matrix M_k that does not depend on p (Vaswani et al., §3.5)."""
    d, L = 32, 200
    table = sinusoidal_table(L, d).double()
    for k in [1, 5, 37]:
        M = torch.zeros(d, d, dtype=torch.float64)
        for i in range(d // 2):
            w = 1.0 / 10000 ** (2 * i / d)
            c, s = math.cos(k * w), math.sin(k * w)
            # [sin(a + b), cos(a + b)] = [[c, s], [-s, c]] @ [sin a, cos a]
            M[2 * i, 2 * i], M[2 * i, 2 * i + 1] = c, s
            M[2 * i + 1, 2 * i], M[2 * i + 1, 2 * i + 1] = -s, c
        for p in [0, 3, 100, L - k - 1]:
            torch.testing.assert_close(M @ table[p], table[p + k], atol=1e-6, rtol=0)


def _rope_reference(x: torch.Tensor, p: int, base: float = 10000.0) -> torch.Tensor:
    """RoPE as complex multiplication: pair (x_i, x_{i+hs/2}) is z_i, rotated by e^{i p θ_i}."""
    hs = x.shape[-1]
    theta = base ** (-torch.arange(0, hs, 2, dtype=torch.float64) / hs)
    z = torch.complex(x[..., : hs // 2].double(), x[..., hs // 2:].double()) * torch.polar(
        torch.ones(hs // 2, dtype=torch.float64), p * theta)
    return torch.cat([z.real, z.imag], dim=-1)


def test_rope_matches_complex_rotation_and_preserves_norm():
    rope = RotaryEmbedding(head_dim=16, context_length=64)
    x = torch.randn(1, 1, 1, 16, dtype=torch.float64)
    for p in [0, 1, 13, 63, 200]:  # 200 is past the precomputed table: ensure() extends it
        rope.ensure(p + 1)
        out = rope(x.float(), torch.tensor([p]))
        torch.testing.assert_close(out.double(), _rope_reference(x, p), atol=1e-5, rtol=0)
        torch.testing.assert_close(out.norm(), x.float().norm(), atol=1e-5, rtol=0)


def test_rope_dot_product_depends_only_on_relative_position():
    rope = RotaryEmbedding(head_dim=32, context_length=512, base=500.0)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 1, 32, generator=g), torch.randn(1, 1, 1, 32, generator=g)

    def score(p, r):
        return (rope(q, torch.tensor([p])) * rope(k, torch.tensor([r]))).sum().item()

    for p, r in [(5, 2), (10, 10), (3, 40)]:
        for shift in [1, 17, 300]:
            assert score(p + shift, r + shift) == pytest.approx(score(p, r), abs=1e-4)
    assert abs(score(5, 2) - score(5, 3)) > 1e-3  # and it does depend on p - r


def test_rope_batched_positions_match_per_row():
    rope = RotaryEmbedding(head_dim=8, context_length=32)
    x = torch.randn(2, 3, 4, 8)
    pos = torch.tensor([[0, 1, 2, 3], [5, 6, 7, 8]])
    out = rope(x, pos)
    torch.testing.assert_close(out[1:], rope(x[1:], torch.arange(5, 9)))
    torch.testing.assert_close(out[:1], rope(x[:1], torch.arange(4)))


def test_alibi_slopes_power_of_two():
    assert alibi_slopes(8).tolist() == [1 / 2 ** i for i in range(1, 9)]
    assert alibi_slopes(16)[0].item() == pytest.approx(2 ** -0.5)


def test_alibi_slopes_not_power_of_two_follow_the_paper():
    # 6 heads: the 4-head slopes 2^-2, 2^-4, 2^-6, 2^-8, then every other 8-head slope: 2^-1, 2^-3.
    expected = [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8, 2 ** -1, 2 ** -3]
    assert alibi_slopes(6).tolist() == pytest.approx(expected)


def test_alibi_matches_transformers_bloom():
    """BLOOM's build_alibi_tensor (an implementation we did not write) for a head count that is not a power of 2."""
    bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom")
    for heads in [5, 8, 12]:
        mask = torch.ones(1, 7)
        ref = bloom.build_alibi_tensor(mask, heads, torch.float32).view(heads, 7)  # slope * key_position
        torch.testing.assert_close(alibi_slopes(heads), ref[:, 1], atol=1e-7, rtol=0)
        # Under a causal mask, softmax is unchanged by a per-row constant: slope * j ≡ -slope * (i - j).
        ours = alibi_bias(alibi_slopes(heads), torch.arange(7), torch.arange(7))
        causal = torch.ones(7, 7, dtype=torch.bool).tril()
        theirs = ref[:, None, :].expand(heads, 7, 7)
        a = torch.softmax(ours.masked_fill(~causal, float("-inf")), -1)
        b = torch.softmax(theirs.masked_fill(~causal, float("-inf")), -1)
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_alibi_bias_is_linear_in_distance():
    bias = alibi_bias(alibi_slopes(4), torch.arange(3, 6), torch.arange(6))
    assert bias.shape == (4, 3, 6)
    assert bias[0, 2, 5].item() == 0.0
    assert bias[1, 2, 1].item() == pytest.approx(-(2 ** -4) * 4)
