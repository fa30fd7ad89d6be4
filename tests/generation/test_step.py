"""The public prefill / decode-step pair: a prompt prefilled and continued one token at a time gives
the logits of one full forward over the whole sequence, on an eager and on a static state.

Reference: the model run once over the whole (left-padded) sequence without any state, fp32, atol
1e-5 on the real tokens (padding queries attend to nothing and are not compared).
"""

import pytest
import torch

from tformer import DecoderLM, TransformerConfig
from tformer.errors import InputError
from tformer.generation.step import decode_step, prefill
from tformer.mixers.kv_cache import KVCache, StaticKVCache
from tformer.mixers.longformer import RingState, StaticRingState

pytestmark = pytest.mark.usefixtures("one_thread")
ATOL = 1e-5
V = 61

CASES = {
    "learned-MHA": dict(positions="learned"),
    "rope-GQA": dict(positions="rope", n_kv_heads=2),
    "rope-MQA-window": dict(positions="rope", n_kv_heads=1, sliding_window=4),
    "alibi-GQA": dict(positions="alibi", n_kv_heads=2),
    "alibi-window": dict(positions="alibi", sliding_window=5),
    "longformer": dict(positions="rope", mixer=["longformer", "attention"],
                       mixer_options={"longformer": {"window": 4, "dilation": 2}}),
    "performer": dict(positions="rope", mixer=["performer", "attention"]),
    "mamba": dict(positions="none", mixer=["mamba", "attention"]),
}


def model_of(**kw):
    torch.manual_seed(0)
    c = TransformerConfig(**{**dict(vocab_size=V, context_length=32, n_layers=2, d_model=32, n_heads=4), **kw})
    return DecoderLM(c).eval()


def left_padded(lengths, T, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (len(lengths), T), generator=g)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, T - n:] = 1
        ids[i, :T - n] = 0
    return ids, mask


def reference(model, ids, mask):
    with torch.no_grad():
        return model(ids, attention_mask=mask, positions=(mask.cumsum(1) - 1).clamp(min=0))[0]   # (B, n, V)


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("case", list(CASES))
def test_prefill_then_decode_steps_equal_one_full_forward(case, static):
    model = model_of(**CASES[case])
    T, steps = 6, 10
    ids, mask = left_padded([6, 2, 4], T)
    g = torch.Generator().manual_seed(2)
    ids = torch.cat([ids, torch.randint(1, V, (3, steps), generator=g)], 1)             # the "generated" tokens
    mask = torch.cat([mask, torch.ones(3, steps, dtype=torch.long)], 1)
    ref = reference(model, ids, mask)
    state = model.new_state(3, T + steps + 3, static=static)                           # larger than needed
    with torch.no_grad():
        got = [prefill(model, ids[:, :T], state, attention_mask=mask[:, :T], chunk=4)]
        for t in range(T, T + steps):   # the held padding comes from state.valid; the static step needs no mask
            real = torch.ones(3, 1, dtype=torch.long) if not static or t % 2 else None
            got.append(decode_step(model, ids[:, t:t + 1], state, attention_mask=real))
    assert state.length == T + steps
    for t, logits in zip(range(T - 1, T + steps), got):
        torch.testing.assert_close(logits, ref[:, t], atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", ["rope-GQA", "longformer"])
def test_static_state_is_a_choice_of_state_class(case):
    model = model_of(**CASES[case])
    eager, static = model.new_state(2, 16), model.new_state(2, 16, static=True)
    want = {KVCache: StaticKVCache, RingState: StaticRingState}
    for a, b in zip(eager.layers, static.layers):
        assert type(b) is want[type(a)]
    assert not eager.static and eager.index is None
    assert static.static and static.index.tolist() == [0, 0]


def test_rows_of_different_lengths_decode_together_at_their_own_index():
    """Right-padded prompts prefilled into some rows of a static state, then decoded with each row's
    own write index and position: every row's logits equal its sequence run alone."""
    model = model_of(positions="rope", n_kv_heads=2, sliding_window=5)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, V, (n,), generator=g) for n in (5, 2, 7)]
    cont = torch.randint(1, V, (3, 6), generator=g)
    pool = model.new_state(4, 20, static=True)
    rows = torch.tensor([3, 0, 1])
    padded = torch.zeros(3, 7, dtype=torch.long)
    for i, p in enumerate(prompts):
        padded[i, :len(p)] = p
    n = torch.tensor([5, 2, 7])
    with torch.no_grad():
        first = prefill(model, padded, pool.writer(rows), last_index=n - 1)             # (3, V)
        pool.hold(rows, n)
        steps = []
        for t in range(6):
            view = pool.rows(0, 4)
            tokens = torch.zeros(4, 1, dtype=torch.long)
            tokens[rows, 0] = cont[:, t]
            index = torch.zeros(4, dtype=torch.long)
            index[rows] = n + t
            view.index.copy_(index)
            steps.append(decode_step(model, tokens, view, positions=index[:, None])[rows])
        for i, p in enumerate(prompts):
            alone = model(torch.cat([p, cont[i]])[None])[0][0]                          # (n + 6, V)
            torch.testing.assert_close(first[i], alone[len(p) - 1], atol=ATOL, rtol=0)
            for t in range(6):
                torch.testing.assert_close(steps[t][i], alone[len(p) + t], atol=ATOL, rtol=0)


def test_a_row_view_writes_through_to_the_state_it_views():
    model = model_of(positions="rope", mixer=["performer", "attention"])
    state = model.new_state(3, 12, static=True)
    row = state.rows(1, 2)
    with torch.no_grad():
        prefill(model, torch.tensor([[5, 6, 7]]), row)
        decode_step(model, torch.tensor([[8]]), row)
    assert state.valid[1, :4].all() and not state.valid[[0, 2]].any()
    assert state.index.tolist() == [0, 4, 0]
    assert state.layers[0].S[1].abs().sum() > 0 and state.layers[0].S[[0, 2]].abs().sum() == 0
    assert state.layers[1].k[1, :, :4].abs().sum() > 0 and state.layers[1].k[[0, 2]].abs().sum() == 0


def test_bad_calls_are_one_sentence():
    model = model_of(positions="rope")
    state = model.new_state(2, 8)
    with pytest.raises(InputError, match="one token per row"):
        decode_step(model, torch.zeros(2, 2, dtype=torch.long), state)
    with pytest.raises(InputError, match="needs a static state"):
        decode_step(model, torch.zeros(2, 1, dtype=torch.long), state, compiled=True)
    with pytest.raises(InputError, match="chunk=4 needs"):
        prefill(model, torch.zeros(2, 3, dtype=torch.long), None, chunk=4)
    with pytest.raises(InputError, match="last_index must be a \\(2,\\) tensor"):
        prefill(model, torch.zeros(2, 3, dtype=torch.long), None, last_index=torch.tensor([1]))
    with pytest.raises(InputError, match="do not fit a state of 2 rows x 8 positions"):
        state.rows(1, 3)
    ring = model_of(positions="rope", mixer="longformer", mixer_options={"longformer": {"window": 4}})
    with pytest.raises(InputError, match="cannot prefill rows in a batch"):
        ring.new_state(2, 8).writer(torch.tensor([0]))
