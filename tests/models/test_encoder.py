"""EncoderModel against PyTorch's own nn.TransformerEncoderLayer (post-norm and pre-norm), plus
padding, pooling and head properties. Tolerance: 1e-5 max abs difference in fp32."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tformer import TransformerConfig
from tformer.models.encoder import EncoderModel, pool

TOL = 1e-5


def config(**kw):
    base = dict(vocab_size=50, context_length=16, n_layers=2, d_model=32, n_heads=4, d_ff=64, causal=False,
                positions="none", norm_placement="post", activation="gelu", norm_eps=1e-12)
    return TransformerConfig(**{**base, **kw})


def torch_reference(model: EncoderModel, norm_first: bool) -> nn.TransformerEncoder:
    """nn.TransformerEncoder carrying the same weights (its in_proj is [W_q; W_k; W_v], like qkv_proj)."""
    c = model.config
    layer = nn.TransformerEncoderLayer(c.d_model, c.n_heads, c.d_ff, dropout=0.0, activation="gelu",
                                       layer_norm_eps=c.norm_eps, batch_first=True, norm_first=norm_first)
    ref = nn.TransformerEncoder(layer, c.n_layers, enable_nested_tensor=False,
                                norm=nn.LayerNorm(c.d_model, eps=c.norm_eps) if norm_first else None)
    with torch.no_grad():
        for ours, theirs in zip(model.blocks, ref.layers):
            theirs.self_attn.in_proj_weight.copy_(ours.attn.qkv_proj.weight)
            theirs.self_attn.in_proj_bias.copy_(ours.attn.qkv_proj.bias)
            theirs.self_attn.out_proj.load_state_dict(ours.attn.out_proj.state_dict())
            theirs.linear1.load_state_dict(ours.ffn.up.state_dict())
            theirs.linear2.load_state_dict(ours.ffn.down.state_dict())
            theirs.norm1.load_state_dict(ours.attn_norm.state_dict())
            theirs.norm2.load_state_dict(ours.ffn_norm.state_dict())
        if norm_first:
            ref.norm.load_state_dict(model.final_norm.state_dict())
    return ref.eval()


def randomize(model):
    torch.manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight") else 0.3 * torch.randn_like(p))
    return model.eval()


@pytest.mark.parametrize("placement", ["post", "pre"])
@pytest.mark.parametrize("backend", ["math", "torch"])
def test_matches_torch_transformer_encoder_with_padding(placement, backend):
    model = randomize(EncoderModel(config(norm_placement=placement, attention_backend=backend)))
    ref = torch_reference(model, norm_first=placement == "pre")
    ids = torch.randint(1, 50, (3, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[1, 6:], mask[2, 3:] = 0, 0
    with torch.no_grad():
        x = model.embed(ids)
        expected = ref(x, src_key_padding_mask=mask == 0)
        got = model(ids, attention_mask=mask)
    keep = mask.bool()
    assert (expected[keep] - got[keep]).abs().max().item() <= TOL


def test_padding_does_not_change_real_tokens():
    model = randomize(EncoderModel(config(positions="learned", embedding_norm=True, type_vocab_size=2)))
    ids = torch.randint(1, 50, (1, 5))
    padded = torch.cat([ids, torch.zeros(1, 4, dtype=torch.long)], dim=1)
    mask = torch.tensor([[1] * 5 + [0] * 4])
    with torch.no_grad():
        alone = model(ids)
        batched = model(padded, attention_mask=mask)[:, :5]
        assert (alone - batched).abs().max().item() <= TOL
        e1, e2 = model.encode(ids), model.encode(padded, mask)
    assert (e1 - e2).abs().max().item() <= TOL
    assert torch.allclose(e1.norm(dim=-1), torch.ones(1))


def test_attention_is_bidirectional():
    model = randomize(EncoderModel(config()))
    ids = torch.randint(1, 50, (1, 6))
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] % 49) + 1
    with torch.no_grad():  # changing the LAST token changes the FIRST token's state (no causal mask)
        assert (model(ids)[0, 0] - model(changed)[0, 0]).abs().max() > 1e-3


def test_pooling_closed_forms():
    hidden = torch.arange(2 * 3 * 2, dtype=torch.float32).view(2, 3, 2)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert torch.equal(pool(hidden, mask, "mean"), torch.stack([hidden[0, :2].mean(0), hidden[1].mean(0)]))
    assert torch.equal(pool(hidden, mask, "cls"), hidden[:, 0])
    with pytest.raises(ValueError, match="pooling"):
        pool(hidden, mask, "max")


def test_mlm_head_is_tied_and_shapes():
    model = EncoderModel(config(), mlm_head=True)
    assert model.mlm_head.embedding.weight is model.tok_emb.weight
    logits = model.mlm_logits(torch.randint(0, 50, (2, 7)))
    assert logits.shape == (2, 7, 50)
    with pytest.raises(ValueError, match="mlm_head=True"):
        EncoderModel(config()).mlm_logits(torch.zeros(1, 2, dtype=torch.long))


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="causal=False"):
        EncoderModel(config(causal=True))
    model = EncoderModel(config(type_vocab_size=2))
    with pytest.raises(ValueError, match="type_vocab_size"):
        model(torch.zeros(1, 3, dtype=torch.long), token_type_ids=torch.full((1, 3), 2))
    with pytest.raises(ValueError, match="token ids"):
        model(torch.full((1, 3), 50))
    with pytest.raises(ValueError, match="type_vocab_size"):
        config(type_vocab_size=-1)
