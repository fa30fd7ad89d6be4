"""The encoder-decoder transformer and its decoding: masks, cached decoding, greedy / beam search.

References: full recomputation (for the cache), padding-free inputs (for the masks), greedy
decoding (for beam 1), an exhaustive enumeration of every output (for beam search), and the
label-smoothed loss written out from its definition.
"""

import itertools

import pytest
import torch
import torch.nn.functional as F

from tformer.config import TransformerConfig
from tformer.errors import ConfigError, InputError
from tformer.generation.beam import beam_search, greedy, sample_decode
from tformer.models import build_model

BOS, EOS, PAD = 1, 2, 0


def tiny(vocab=11, init_std=0.3, **kw):
    torch.manual_seed(0)
    cfg = TransformerConfig(model="encoder-decoder", vocab_size=vocab, d_model=32, n_heads=4, n_layers=2,
                            encoder_layers=1, context_length=16, positions="sinusoidal", norm_placement="post",
                            embedding_scale=True, init_std=init_std, **kw)
    return build_model(cfg).eval()


def test_registry_and_config(one_thread):
    model = tiny()
    assert type(model).__name__ == "EncoderDecoder" and len(model.encoder.blocks) == 1 and len(model.decoder.blocks) == 2
    assert model.lm_head.weight is model.encoder.tok_emb.weight is model.decoder.tok_emb.weight
    with pytest.raises(ConfigError):
        TransformerConfig(model="encoder-decoder", encoder_layers=0)
    with pytest.raises(ConfigError):
        build_model(TransformerConfig(model="encoder-decoder", positions="rope"))


def test_padding_on_either_side_changes_nothing(one_thread):
    model = tiny()
    src = torch.tensor([[3, 4, 5, 6]])
    tgt = torch.tensor([[BOS, 7, 8]])
    ref = model(src, tgt)[0]                                                       # no padding at all
    ones = torch.ones(1, 4, dtype=torch.long)
    for src_p, m in [(torch.cat([src, torch.tensor([[PAD, PAD]])], 1), torch.cat([ones, torch.zeros(1, 2).long()], 1)),
                     (torch.cat([torch.tensor([[PAD, PAD]]), src], 1), torch.cat([torch.zeros(1, 2).long(), ones], 1))]:
        out = model(src_p, tgt, src_mask=m)[0]
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    tmask = torch.tensor([[1, 1, 1, 0, 0]])                                       # target padded on the right
    out = model(src, torch.cat([tgt, torch.tensor([[PAD, PAD]])], 1), tgt_mask=tmask)[0]
    torch.testing.assert_close(out[:, :3], ref, atol=1e-5, rtol=1e-5)
    out = model(src, torch.cat([torch.tensor([[PAD, PAD]]), tgt], 1), tgt_mask=tmask.flip(1))[0]   # and on the left
    torch.testing.assert_close(out[:, 2:], ref, atol=1e-5, rtol=1e-5)


def test_cached_decoding_equals_recomputation(one_thread):
    model = tiny()
    src = torch.tensor([[3, 4, 5, 6, 7], [8, 9, 3, PAD, PAD]])
    src_mask = (src != PAD).long()
    tgt = torch.tensor([[BOS, 5, 6, 7, 8, 9], [BOS, 4, 4, 3, 10, 5]])
    full = model(src, tgt, src_mask=src_mask)[0]                                   # (2, 6, V) recomputed
    state = model.new_state(src, src_mask, max_len=6)
    steps = [model.decode_step(tgt[:, :2], state)]                                 # a two-token prefill, then one by one
    steps += [model.decode_step(tgt[:, t:t + 1], state) for t in range(2, 6)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
    assert state.length == 6 and state.nbytes > 0


def test_label_smoothed_loss_matches_its_definition(one_thread):
    model = tiny()
    src, tgt = torch.tensor([[3, 4, 5]]), torch.tensor([[BOS, 6, 7]])
    targets = torch.tensor([[6, 7, -100]])
    with torch.no_grad():
        logits, loss = model(src, tgt, targets, label_smoothing=0.1)
    logp = logits[0, :2].double().log_softmax(-1)
    nll = -logp[torch.arange(2), targets[0, :2]]
    ref = (0.9 * nll + 0.1 * (-logp.mean(-1))).mean()
    assert abs(loss.item() - ref.item()) < 1e-5


def test_cross_attention_maps_are_distributions_over_real_tokens(one_thread):
    model = tiny()
    src = torch.tensor([[3, 4, 5, PAD]])
    maps = model.cross_attention_maps(src, torch.tensor([[BOS, 6]]), src_mask=(src != PAD).long())
    assert len(maps) == 2 and maps[0].shape == (1, 4, 2, 4)
    torch.testing.assert_close(maps[0].sum(-1), torch.ones(1, 4, 2))
    assert float(maps[1][..., 3].abs().max()) == 0.0


def test_beam_of_one_is_greedy(one_thread):
    model = tiny()
    src = torch.tensor([[3, 4, 5, 6], [7, 8, PAD, PAD], [9, 10, 3, PAD]])
    mask = (src != PAD).long()
    ref = greedy(model, src, mask, bos=BOS, eos=EOS, max_new_tokens=8)
    for penalty in (0.0, 1.0, 2.0):
        got = beam_search(model, src, mask, bos=BOS, eos=EOS, num_beams=1, max_new_tokens=8, length_penalty=penalty)
        assert [h[0].tokens for h in got] == ref
    # greedy, batched, equals greedy one source at a time
    assert [greedy(model, src[i:i + 1, :int(mask[i].sum())], bos=BOS, eos=EOS, max_new_tokens=8)[0]
            for i in range(3)] == ref


@torch.no_grad()
def _brute_force(model, src, V, max_new, penalty):
    """Every output (EOS-terminated, or cut at max_new), scored by full recomputation."""
    outs = []
    for n in range(1, max_new + 1):
        for body in itertools.product([t for t in range(V) if t != EOS], repeat=n - 1):
            for last in range(V):
                if n < max_new and last != EOS:
                    continue
                seq = list(body) + [last]
                tgt = torch.tensor([[BOS] + seq[:-1]])
                logp = model(src, tgt)[0][0].double().log_softmax(-1)
                total = float(logp[torch.arange(n), torch.tensor(seq)].sum())
                outs.append((total / n ** penalty, seq))
    return sorted(outs, key=lambda x: -x[0])


@pytest.mark.parametrize("penalty", [0.0, 1.0])
def test_beam_search_equals_exhaustive_search(one_thread, penalty):
    V, max_new = 4, 3
    model = tiny(vocab=V, init_std=0.5)
    src = torch.tensor([[3, 1, 3]])
    ref = _brute_force(model, src, V, max_new, penalty)
    got = beam_search(model, src, bos=BOS, eos=EOS, num_beams=40, max_new_tokens=max_new,
                      length_penalty=penalty, early_stopping="never", n_best=5)[0]
    assert [h.tokens for h in got] == [seq for _, seq in ref[:5]]
    assert max(abs(h.score - s) for h, (s, _) in zip(got, ref)) < 1e-5
    # a narrow beam still returns a well-formed list, best first, no better than the optimum
    narrow = beam_search(model, src, bos=BOS, eos=EOS, num_beams=2, max_new_tokens=max_new,
                         length_penalty=penalty, n_best=2)[0]
    assert narrow[0].score >= narrow[1].score and narrow[0].score <= ref[0][0] + 1e-5


def test_sampling_is_reproducible_and_bad_input_is_refused(one_thread):
    model = tiny()
    src = torch.tensor([[3, 4, 5]])
    a = sample_decode(model, src, bos=BOS, eos=EOS, temperature=1.0, seed=3, max_new_tokens=6)
    b = sample_decode(model, src, bos=BOS, eos=EOS, temperature=1.0, seed=3, max_new_tokens=6)
    assert a == b and 1 <= len(a[0]) <= 6
    with pytest.raises(InputError):
        beam_search(model, src, bos=BOS, eos=EOS, num_beams=2, n_best=3)
    with pytest.raises(InputError):
        greedy(model, src, bos=BOS, eos=EOS, max_new_tokens=0)


def test_sampling_a_batch_equals_each_source_alone(one_thread):
    """Rows are seeded alike (as in tformer.generation.generate), so a row does not depend on its index."""
    model = tiny()
    src = torch.tensor([[3, 4, 5, 6], [7, 8, PAD, PAD]])
    mask = (src != PAD).long()
    both = sample_decode(model, src, mask, bos=BOS, eos=EOS, temperature=1.0, seed=5, max_new_tokens=8)
    alone = [sample_decode(model, src[i:i + 1, :int(mask[i].sum())], bos=BOS, eos=EOS, temperature=1.0, seed=5,
                           max_new_tokens=8)[0] for i in range(2)]
    assert both == alone


def test_reorder_copies_rows_in_place(one_thread):
    model = tiny()
    src = torch.tensor([[3, 4, 5], [6, 7, 8]])
    state = model.new_state(src, max_len=4).repeat(2)                                  # 4 rows
    model.decode_step(torch.tensor([[BOS], [3], [4], [5]]), state)
    before = [(s.k.clone(), s.v.clone(), s.k.data_ptr()) for s in state.decoder.layers]
    valid = state.decoder.valid.clone()
    state.reorder(torch.tensor([0, 0, 3]), torch.tensor([1, 0, 2]))                    # rows 1, 0, 2 <- 0, 0, 3
    pick = torch.tensor([0, 0, 3, 3])
    for s, (k, v, ptr) in zip(state.decoder.layers, before):
        assert s.k.data_ptr() == ptr                                                   # the same buffer
        assert torch.equal(s.k, k[pick]) and torch.equal(s.v, v[pick])
    assert torch.equal(state.decoder.valid, valid[pick])


def test_beam_search_makes_one_host_sync_per_step(one_thread, monkeypatch):
    model = tiny()
    src = torch.tensor([[3, 4, 5, 6], [7, 8, PAD, PAD]])
    calls = {"tolist": 0, "scalar": 0}
    tolist, item = torch.Tensor.tolist, torch.Tensor.item

    def count(name, f):
        def wrapped(*a, **k):
            calls[name] += 1
            return f(*a, **k)
        return wrapped
    monkeypatch.setattr(torch.Tensor, "tolist", count("tolist", tolist))
    for name in ("item", "__int__", "__float__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, count("scalar", getattr(torch.Tensor, name)))
    beam_search(model, src, (src != PAD).long(), bos=BOS, eos=EOS, num_beams=3, max_new_tokens=6,
                early_stopping="never")
    assert calls == {"tolist": 6, "scalar": 0}
