"""QK-norm: each head's q and k divided by its RMS before the scores, against a float64 reference."""

import math

import torch

from tformer.config import TransformerConfig
from tformer.generation.step import decode_step, prefill
from tformer.mixers.attention import MultiHeadAttention
from tformer.models import build_model


def _reference(att: MultiHeadAttention, x: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention written out in float64 with q, k RMS-normalised per head (eps 1e-6)."""
    B, T, C = x.shape
    nh, hs = att.n_heads, att.head_dim
    W, Wo = att.qkv_proj.weight.double(), att.out_proj.weight.double()
    qkv = (x.double() @ W.T).view(B, T, 3, nh, hs)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))             # (B, nh, T, hs)
    rms = lambda t: t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6)  # noqa: E731
    q, k = rms(q), rms(k)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hs)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, nh * hs)
    return out @ Wo.T


def test_qk_norm_attention_matches_the_float64_reference():
    torch.manual_seed(0)
    cfg = TransformerConfig(d_model=32, n_heads=4, context_length=16, bias=False, qk_norm=True, positions="learned")
    att = MultiHeadAttention(cfg).eval()
    x = torch.randn(2, 11, 32)
    got = att(x)
    assert torch.allclose(got.double(), _reference(att, x), atol=1e-5), (got.double() - _reference(att, x)).abs().max()


def test_qk_norm_makes_scores_independent_of_the_q_and_k_scale():
    """Scaling W_Q, W_K and their biases by 7 changes nothing with QK-norm, and changes the output without it."""
    torch.manual_seed(0)
    x = torch.randn(1, 9, 32)
    outs = {}
    for norm in (True, False):
        cfg = TransformerConfig(d_model=32, n_heads=4, context_length=16, qk_norm=norm, positions="rope")
        torch.manual_seed(1)
        att = MultiHeadAttention(cfg, rope=build_model(cfg).rope).eval()
        before = att(x)
        with torch.no_grad():
            att.qkv_proj.weight[:64].mul_(7.0)                              # the q and k rows
            att.qkv_proj.bias[:64].mul_(7.0)
        outs[norm] = (before - att(x)).abs().max().item()
    assert outs[True] < 1e-4 and outs[False] > 1e-2, outs


def test_qk_norm_decoding_with_the_cache_equals_the_full_forward():
    """Keys are written to the cache normalised and rotated: decode step by step = one forward."""
    torch.manual_seed(0)
    model = build_model(TransformerConfig(vocab_size=19, context_length=16, n_layers=2, d_model=32, n_heads=4,
                                          positions="rope", qk_norm=True)).eval()
    ids = torch.randint(0, 19, (1, 10))
    with torch.no_grad():
        full = model(ids)[0][:, -1]
        state = model.new_state(1, 16)
        prefill(model, ids[:, :6], state)
        for t in range(6, 10):
            last = decode_step(model, ids[:, t:t + 1], state)
    assert torch.allclose(last.reshape(full.shape), full, atol=1e-5)
