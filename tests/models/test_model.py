"""Heads, blocks and the decoder LM against PyTorch's own modules and the transformer's defining properties."""

import math

import pytest
import torch
import torch.nn as nn

from tformer import DecoderLM, MultiHeadAttention, TransformerConfig, count_parameters
from tformer.mixers.attention import CrossAttention
from tformer.models.block import Block
from tformer.nn.norms import RMSNorm

POSITIONS = ["none", "learned", "sinusoidal", "rope", "alibi"]


def _cfg(**kw):
    base = dict(vocab_size=50, context_length=32, n_layers=2, d_model=32, n_heads=4, dropout=0.0)
    return TransformerConfig(**{**base, **kw})


@pytest.mark.parametrize("causal", [False, True])
def test_multihead_attention_equals_torch_multiheadattention(causal):
    """Same weights in torch.nn.MultiheadAttention (an independent implementation) give the same output."""
    torch.manual_seed(0)
    c = _cfg(causal=causal, positions="none", attention_backend="math")
    ours = MultiHeadAttention(c)
    ref = nn.MultiheadAttention(32, 4, bias=True, batch_first=True)
    with torch.no_grad():
        ref.in_proj_weight.copy_(ours.qkv_proj.weight)  # [W_Q; W_K; W_V], as fused in ours
        ref.in_proj_bias.copy_(ours.qkv_proj.bias)
        ref.out_proj.weight.copy_(ours.out_proj.weight)
        ref.out_proj.bias.copy_(ours.out_proj.bias)
    x = torch.randn(3, 10, 32)
    mask = torch.triu(torch.ones(10, 10, dtype=torch.bool), 1) if causal else None  # True = blocked there
    expected, _ = ref(x, x, x, attn_mask=mask, need_weights=False)
    for backend in ["math", "torch"]:
        ours.backend = backend
        torch.testing.assert_close(ours(x), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("placement", ["pre", "post"])
def test_block_equals_torch_transformer_encoder_layer(placement):
    """Pre-norm = norm_first=True, post-norm = norm_first=False, in torch.nn.TransformerEncoderLayer."""
    torch.manual_seed(1)
    c = _cfg(causal=False, positions="none", norm_placement=placement, activation="gelu")
    ours = Block(c).eval()
    ref = nn.TransformerEncoderLayer(32, 4, dim_feedforward=128, dropout=0.0, activation="gelu",
                                     batch_first=True, norm_first=placement == "pre").eval()
    with torch.no_grad():
        ref.self_attn.in_proj_weight.copy_(ours.attn.qkv_proj.weight)
        ref.self_attn.in_proj_bias.copy_(ours.attn.qkv_proj.bias)
        ref.self_attn.out_proj.weight.copy_(ours.attn.out_proj.weight)
        ref.self_attn.out_proj.bias.copy_(ours.attn.out_proj.bias)
        ref.linear1.weight.copy_(ours.ffn.up.weight)
        ref.linear1.bias.copy_(ours.ffn.up.bias)
        ref.linear2.weight.copy_(ours.ffn.down.weight)
        ref.linear2.bias.copy_(ours.ffn.down.bias)
        for theirs, mine in [(ref.norm1, ours.attn_norm), (ref.norm2, ours.ffn_norm)]:
            theirs.weight.copy_(mine.weight + torch.randn(32) * 0.1)
            theirs.bias.copy_(torch.randn(32) * 0.1)
            mine.weight.copy_(theirs.weight)
            mine.bias.copy_(theirs.bias)
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x), atol=1e-5, rtol=0)


def test_rmsnorm_equals_torch_rmsnorm():
    x = torch.randn(4, 7, 16)
    ours, ref = RMSNorm(16, eps=1e-6), nn.RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(16))
        ref.weight.copy_(ours.weight)
    torch.testing.assert_close(ours(x), ref(x), atol=1e-6, rtol=0)


def test_self_attention_and_block_are_permutation_equivariant_without_positions():
    torch.manual_seed(2)
    c = _cfg(causal=False, positions="none")
    attn, block = MultiHeadAttention(c), Block(c)
    x = torch.randn(2, 12, 32)
    perm = torch.randperm(12)
    for f in (attn, block):
        torch.testing.assert_close(f(x)[:, perm], f(x[:, perm]), atol=1e-5, rtol=0)
    # and a positional scheme breaks it, as it should
    rope_block = Block(_cfg(causal=False, positions="rope"), rope=__import__("tformer.nn.positions").nn.positions.RotaryEmbedding(8, 32))
    assert not torch.allclose(rope_block(x)[:, perm], rope_block(x[:, perm]), atol=1e-3)


@pytest.mark.parametrize("positions", POSITIONS)
@pytest.mark.parametrize("backend", ["math", "torch"])
def test_causal_logits_ignore_the_future(positions, backend):
    torch.manual_seed(3)
    model = DecoderLM(_cfg(positions=positions, attention_backend=backend)).eval()
    ids = torch.randint(0, 50, (2, 16))
    changed = ids.clone()
    changed[:, 9:] = torch.randint(0, 50, (2, 7))
    a, _ = model(ids)
    b, _ = model(changed)
    torch.testing.assert_close(a[:, :9], b[:, :9], atol=1e-5, rtol=0)
    assert not torch.allclose(a[:, 9:], b[:, 9:])


def _mha_from_gqa(gqa: MultiHeadAttention, c_mha: TransformerConfig) -> MultiHeadAttention:
    """An MHA module whose K/V projections repeat each GQA kv head for its query group."""
    mha = MultiHeadAttention(c_mha)
    H, Hkv, hs = gqa.n_heads, gqa.n_kv_heads, gqa.head_dim
    wq, wk, wv = gqa.qkv_proj.weight.split([H * hs, Hkv * hs, Hkv * hs])
    rep = lambda w: w.view(Hkv, hs, -1).repeat_interleave(H // Hkv, 0).reshape(H * hs, -1)
    with torch.no_grad():
        mha.qkv_proj.weight.copy_(torch.cat([wq, rep(wk), rep(wv)]))
        mha.out_proj.weight.copy_(gqa.out_proj.weight)
    return mha


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
@pytest.mark.parametrize("backend", ["math", "torch"])
def test_gqa_equals_mha_with_repeated_kv_weights(n_kv_heads, backend):
    torch.manual_seed(4)
    kw = dict(positions="rope", bias=False, attention_backend=backend)
    gqa = MultiHeadAttention(_cfg(n_kv_heads=n_kv_heads, **kw),
                             rope=__import__("tformer.nn.positions").nn.positions.RotaryEmbedding(8, 32))
    mha = _mha_from_gqa(gqa, _cfg(**kw))
    mha.rope = gqa.rope
    x = torch.randn(2, 11, 32)
    torch.testing.assert_close(gqa(x), mha(x), atol=1e-5, rtol=0)
    if n_kv_heads == 4:  # n_kv_heads == n_heads *is* MHA: same parameters, same module
        assert sum(p.numel() for p in gqa.parameters()) == sum(p.numel() for p in mha.parameters())


def test_mqa_parameter_count():
    d, H = 64, 8
    hs = d // H
    c = TransformerConfig(d_model=d, n_heads=H, n_kv_heads=1, bias=False, n_layers=1)
    attn = MultiHeadAttention(c)
    expected = d * d + 2 * d * hs + d * d  # W_Q, one K head, one V head, W_O
    assert sum(p.numel() for p in attn.parameters()) == expected == count_parameters(c).per_layer_attention
    x = torch.randn(1, 5, d)
    assert attn(x).shape == (1, 5, d)


def test_loss_at_init_is_about_log_vocab_and_backward_is_finite():
    torch.manual_seed(5)
    model = DecoderLM(_cfg(vocab_size=200, positions="learned"))
    ids = torch.randint(0, 200, (4, 32))
    logits, loss = model(ids[:, :-1], ids[:, 1:])
    assert logits.shape == (4, 31, 200)
    assert abs(loss.item() - math.log(200)) < 0.2
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert model.lm_head.weight is model.tok_emb.weight  # tied by default


def test_explicit_positions_equal_offsets():
    torch.manual_seed(6)
    for positions in POSITIONS:
        model = DecoderLM(_cfg(positions=positions)).eval()
        ids = torch.randint(0, 50, (2, 8))
        a, _ = model(ids)
        b, _ = model(ids, positions=torch.arange(8).expand(2, 8))
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_attention_maps_rows_sum_to_one_and_are_causal():
    model = DecoderLM(_cfg()).eval()
    maps = model.attention_maps(torch.randint(0, 50, (1, 10)))
    assert len(maps) == 2 and maps[0].shape == (1, 4, 10, 10)
    for w in maps:
        torch.testing.assert_close(w.sum(-1), torch.ones(1, 4, 10))
        assert torch.all(w.triu(1) == 0)


def test_bad_inputs_raise_clear_errors():
    model = DecoderLM(_cfg(positions="learned"))
    with pytest.raises(ValueError, match="beyond context_length=32"):
        model(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 50\)"):
        model(torch.full((1, 4), 50))
    with pytest.raises(ValueError, match="integer tensor"):
        model(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="causal=True"):
        DecoderLM(_cfg(causal=False))


def test_cross_attention_equals_torch_multiheadattention():
    torch.manual_seed(7)
    c = _cfg(causal=True, positions="rope")  # cross-attention ignores causality and positions
    ours = CrossAttention(c)
    ref = nn.MultiheadAttention(32, 4, bias=True, batch_first=True)
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([ours.q_proj.weight, ours.kv_proj.weight]))
        ref.in_proj_bias.copy_(torch.cat([ours.q_proj.bias, ours.kv_proj.bias]))
        ref.out_proj.weight.copy_(ours.out_proj.weight)
        ref.out_proj.bias.copy_(ours.out_proj.bias)
    x, memory = torch.randn(2, 5, 32), torch.randn(2, 9, 32)
    pad = torch.ones(2, 9, dtype=torch.bool)
    pad[1, 6:] = False
    expected, _ = ref(x, memory, memory, key_padding_mask=~pad, need_weights=False)
    torch.testing.assert_close(ours(x, context=memory, mask=pad[:, None, None, :]), expected, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="context"):
        ours(x)


def test_block_with_cross_attention_runs_and_uses_the_context():
    torch.manual_seed(8)
    c = _cfg(positions="none")
    block = Block(c, cross_attention=CrossAttention(c))
    x, memory = torch.randn(1, 4, 32), torch.randn(1, 6, 32)
    a = block(x, context=memory)
    b = block(x, context=memory + 1.0)
    assert a.shape == (1, 4, 32) and not torch.allclose(a, b)


@pytest.mark.parametrize("positions", POSITIONS)
def test_left_padding_changes_nothing_for_the_real_tokens(positions):
    """With an attention mask, positions count real tokens only: a left-padded row gives the logits
    of the same tokens without padding."""
    torch.manual_seed(9)
    model = DecoderLM(_cfg(positions=positions)).eval()
    ids = torch.randint(0, 50, (1, 7))
    alone, _ = model(ids)
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], dim=1)
    mask = torch.tensor([[0, 0, 0] + [1] * 7])
    logits, _ = model(padded, attention_mask=mask)
    torch.testing.assert_close(logits[:, 3:], alone, atol=1e-5, rtol=0)
