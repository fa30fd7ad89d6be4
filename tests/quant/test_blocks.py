"""GGUF block formats: tformer's packing is ggml's byte for byte (checked against the gguf package's
own quantize / dequantize, which mirror ggml-quants.c), the unpacking inverts it, and the error
against float32 on GPT-2-scale weights stays within each format's rounding bound."""

import numpy as np
import pytest
import torch

from tformer.errors import ConfigError, InputError
from tformer.quant import blocks

gguf = pytest.importorskip("gguf", reason="the optional extra 'gguf' is not installed")
from gguf import quants  # noqa: E402

GGML = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0,
        "q4_1": gguf.GGMLQuantizationType.Q4_1}


def awkward(n=24, k=256, seed=0):
    """Random rows of varied scale plus the edge cases of the rounding rules."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-4, 1, n)[:, None]
    w[0, :32] = 0                                                 # d = 0
    w[1, :32] = 0.5; w[1, 3] = -0.5                               # ties of |max|: first one wins (q4_0)
    w[2, 32:64] = torch.arange(32) / 31 * 8 - 4                   # exact halves of a step
    w[3, :32] = 1e-6                                              # constant block (q4_1: d = 0)
    # integers; + 0.0 turns -0 into +0: which zero is the min is not defined alike by numpy and torch
    w[4, :] = w[4, :].round() + 0.0
    w[5, :32] = 7e4                                               # d beyond fp16's range: inf, as ggml
    return w


@pytest.mark.parametrize("fmt", blocks.FORMATS)
def test_block_sizes_and_type_numbers_are_ggmls(fmt):
    size, bytes_ = gguf.GGML_QUANT_SIZES[GGML[fmt]]
    assert (size, bytes_) == (blocks.BLOCK, blocks.BYTES[fmt])
    assert int(GGML[fmt]) == blocks.GGML_TYPE[fmt]


@pytest.mark.parametrize("fmt", blocks.FORMATS)
@pytest.mark.parametrize("seed", [0, 1])
def test_packing_equals_gguf_byte_for_byte(fmt, seed):
    w = awkward(seed=seed)
    ours = blocks.quantize(w, fmt)
    theirs = quants.quantize(w.numpy(), GGML[fmt])
    assert ours.dtype == torch.uint8 and ours.shape == theirs.shape == (24, 256 // 32 * blocks.BYTES[fmt])
    with np.errstate(invalid="ignore", over="ignore"):
        assert np.array_equal(ours.numpy(), theirs), int((ours.numpy() != theirs).sum())


@pytest.mark.parametrize("fmt", blocks.FORMATS)
def test_dequantize_equals_gguf(fmt):
    w = awkward(seed=3)[6:]                                       # finite scales (gguf's inf * 0 is nan)
    packed = quants.quantize(w.numpy(), GGML[fmt])
    ours = blocks.dequantize(torch.from_numpy(packed), fmt).numpy()
    assert np.array_equal(ours, quants.dequantize(packed, GGML[fmt]))


@pytest.mark.parametrize("fmt, step, codes", [("q8_0", lambda b: b.abs().amax(-1) / 127, 127),
                                              ("q4_0", lambda b: b.abs().amax(-1) / 8, 8),
                                              ("q4_1", lambda b: (b.amax(-1) - b.amin(-1)) / 15, 15)])
def test_error_against_fp32_on_gpt2_scale_weights(fmt, step, codes):
    """Each weight is within half a step of its block's grid plus the scales' fp16 rounding (half
    an ulp, 2⁻¹¹ relative, times at most ``codes`` steps; q4_1 adds its min's, 2⁻¹¹ · |min|). The
    RMS error relative to the weights' RMS is bounded near its measured value: q8_0 0.0054,
    q4_0 0.086, q4_1 0.078 on 768x3072 std-0.02 Gaussian weights."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(768, 3072, generator=g) * 0.02
    err = (blocks.dequantize(blocks.quantize(w, fmt), fmt) - w).view(768, -1, 32)
    b = w.view(768, -1, 32)
    s = step(b)[..., None]
    bound = s / 2 + codes * s * 2.0**-11 + (b.amin(-1, keepdim=True).abs() * 2.0**-11 if fmt == "q4_1" else 0)
    if fmt == "q4_0":           # codes reach -8 steps on the max's side but only +7 on the other: a full step there
        M = b.gather(-1, b.abs().argmax(-1, keepdim=True))
        bound = bound + torch.where(b / (M / -8) > 7.5, s / 2, 0)
    assert bool((err.abs() <= bound * (1 + 1e-6)).all()), float((err.abs() / bound).max())
    rel = (err.pow(2).mean() / w.pow(2).mean()).sqrt().item()
    assert rel < {"q8_0": 0.006, "q4_0": 0.095, "q4_1": 0.085}[fmt], rel


def test_unpack_codes():
    w = torch.tensor([[float(j - 16) for j in range(32)]])
    q, d, m = blocks.unpack(blocks.quantize(w, "q4_1"), "q4_1")
    assert q.shape == (1, 1, 32) and int(q.min()) == 0 and int(q.max()) == 15
    assert float(m[0, 0]) == -16.0 and float(d[0, 0]) == pytest.approx(31 / 15, rel=1e-3)


def test_activation_rounding_is_round_half_to_even():
    x = torch.zeros(1, 32)
    x[0, 0] = 127.0                                              # scale 1: codes are the values themselves
    x[0, 1:5] = torch.tensor([0.5, 1.5, 2.5, -0.5])
    q, dx, s = blocks.quantize_activation(x)
    assert q[0, 0, :5].tolist() == [127, 0, 2, 2, 0] and float(dx[0, 0]) == 1.0 and int(s[0, 0]) == 131


def test_bad_input_is_named():
    with pytest.raises(ConfigError, match="unknown block format 'q5_0'"):
        blocks.quantize(torch.zeros(2, 32), "q5_0")
    with pytest.raises(InputError, match="multiple of 32"):
        blocks.quantize(torch.zeros(2, 40), "q8_0")
    with pytest.raises(InputError, match="uint8"):
        blocks.dequantize(torch.zeros(2, 34), "q8_0")
