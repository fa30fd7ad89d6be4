"""Bahdanau's RNN encoder-decoder and its attention-free twin.

References: the additive score written out per source position in float64; the bidirectional GRU
run on each unpadded sequence alone; greedy decoding (for beam 1).
"""

import pytest
import torch

from tformer.config import TransformerConfig
from tformer.errors import ConfigError
from tformer.generation.beam import beam_search, greedy
from tformer.models import build_model
from tformer.models.rnn_seq2seq import AdditiveAttention

BOS, EOS, PAD = 1, 2, 0


def rnn(kind="bahdanau"):
    torch.manual_seed(0)
    return build_model(TransformerConfig(model=kind, vocab_size=13, d_model=16, n_layers=1, init_std=0.5)).eval()


def test_additive_score_matches_its_definition(one_thread):
    torch.manual_seed(0)
    att = AdditiveAttention(5, 6).double()
    s, h = torch.randn(2, 5, dtype=torch.float64), torch.randn(2, 4, 6, dtype=torch.float64)
    mask = torch.tensor([[True, True, True, False], [True, True, True, True]])
    ctx, w = att(s, att.U(h), h, mask)
    W, U, b, v = att.W.weight, att.U.weight, att.U.bias, att.v.weight[0]
    for i in range(2):
        e = torch.stack([v @ torch.tanh(W @ s[i] + U @ h[i, j] + b) for j in range(4)])    # vᵀ tanh(W s + U h_j)
        e = torch.where(mask[i], e, torch.tensor(float("-inf"), dtype=e.dtype))
        ref_w = torch.exp(e - e.max()) / torch.exp(e - e.max()).sum()
        torch.testing.assert_close(w[i], ref_w, atol=1e-12, rtol=0)
        torch.testing.assert_close(ctx[i], (ref_w[:, None] * h[i]).sum(0), atol=1e-12, rtol=0)


def test_encoder_equals_the_gru_on_each_sequence_alone(one_thread):
    model = rnn()
    src = torch.tensor([[3, 4, 5, 6], [PAD, 7, 8, 9], [10, 11, PAD, PAD]])
    h, mask, s0 = model.encode(src, (src != PAD).long())
    for i, real in enumerate([[3, 4, 5, 6], [7, 8, 9], [10, 11]]):
        alone, last = model.encoder(model.tok_emb(torch.tensor([real])))
        torch.testing.assert_close(h[i, :len(real)], alone[0], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(s0[i], torch.tanh(model.init(last[1, 0])), atol=1e-6, rtol=1e-5)
        assert mask[i].sum() == len(real) and bool(mask[i, :len(real)].all())


@pytest.mark.parametrize("kind", ["bahdanau", "rnn-encoder-decoder"])
def test_padding_on_either_side_changes_nothing(one_thread, kind):
    model = rnn(kind)
    src, tgt = torch.tensor([[3, 4, 5]]), torch.tensor([[BOS, 6, 7, 8]])
    ref = model(src, tgt)[0]
    for padded in ([[PAD, PAD, 3, 4, 5]], [[3, 4, 5, PAD, PAD]]):
        padded = torch.tensor(padded)
        torch.testing.assert_close(model(padded, tgt, src_mask=(padded != PAD).long())[0], ref, atol=1e-6, rtol=1e-5)
    right = model(src, torch.tensor([[BOS, 6, 7, 8, PAD]]))[0]                    # target padded on the right
    torch.testing.assert_close(right[:, :4], ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("kind", ["bahdanau", "rnn-encoder-decoder"])
def test_step_decoding_and_beam_of_one(one_thread, kind):
    model = rnn(kind)
    src = torch.tensor([[3, 4, 5, 6], [7, 8, PAD, PAD]])
    mask = (src != PAD).long()
    tgt = torch.tensor([[BOS, 5, 6, 7], [BOS, 9, 9, 3]])
    full = model(src, tgt, src_mask=mask)[0]
    state = model.new_state(src, mask)
    steps = torch.cat([model.decode_step(tgt[:, t:t + 1], state) for t in range(4)], 1)
    torch.testing.assert_close(steps, full, atol=1e-6, rtol=1e-5)
    ref = greedy(model, src, mask, bos=BOS, eos=EOS, max_new_tokens=6)
    got = beam_search(model, src, mask, bos=BOS, eos=EOS, num_beams=1, max_new_tokens=6)
    assert [h[0].tokens for h in got] == ref


def test_attention_weights_for_plots(one_thread):
    model = rnn()
    src = torch.tensor([[3, 4, 5, PAD]])
    w = model.attention_weights(src, torch.tensor([[BOS, 6, 7]]), (src != PAD).long())
    assert w.shape == (1, 3, 4)
    torch.testing.assert_close(w.sum(-1), torch.ones(1, 3))
    assert float(w[..., 3].max()) == 0.0
    with pytest.raises(ConfigError):
        rnn("rnn-encoder-decoder").attention_weights(src, torch.tensor([[BOS]]))
    with pytest.raises(ConfigError):
        build_model(TransformerConfig(model="bahdanau", n_layers=2))
