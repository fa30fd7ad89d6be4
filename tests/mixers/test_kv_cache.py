"""KV cache: cached decoding equals full recomputation, for every position scheme and head layout.

Reference: the model run over the whole sequence without a cache (fp32, atol 1e-5), and each
prompt run alone without padding.
"""

import pytest
import torch

from tformer import DecoderLM, TransformerConfig, kv_cache_bytes
from tformer.generation.step import decode_step, prefill
from tformer.mixers.kv_cache import KVCache

POSITIONS = ["none", "learned", "sinusoidal", "rope", "alibi"]
LAYOUTS = {"MHA": 4, "GQA": 2, "MQA": 1}
ATOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(positions="learned", n_kv_heads=4, **kw):
    torch.manual_seed(0)
    c = TransformerConfig(vocab_size=61, context_length=32, n_layers=2, d_model=32, n_heads=4,
                          n_kv_heads=n_kv_heads, positions=positions, **kw)
    return DecoderLM(c).eval()


def padded_batch(lengths, T, vocab=61, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (len(lengths), T), generator=g)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, T - n:] = 1
        ids[i, :T - n] = 0
    return ids, mask


def positions_of(mask):
    return (mask.cumsum(1) - 1).clamp(min=0)


def full_logits(model, ids, mask):
    """Logits of the whole sequence in one uncached pass: the reference."""
    with torch.no_grad():
        if mask is None:
            return model(ids)[0]
        return model(ids, attention_mask=mask, positions=positions_of(mask))[0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("positions", POSITIONS)
@pytest.mark.parametrize("padded", [False, True], ids=["B1", "B3-leftpad"])
def test_cached_logits_equal_full_recomputation(positions, layout, padded):
    model = tiny(positions, LAYOUTS[layout])
    T, steps = 7, 9
    if padded:
        ids, mask = padded_batch([7, 3, 5], T + steps)
        ids, mask = ids, mask
        mask[:, T:] = 1                      # generated tokens are real tokens
    else:
        ids, mask = torch.randint(0, 61, (1, T + steps), generator=torch.Generator().manual_seed(2)), None
    ref = full_logits(model, ids, mask)                                       # (B, T+steps, V)
    pos = positions_of(mask) if mask is not None else None
    attrs = sorted(vars(model.blocks[0].attn))
    state = model.new_state(ids.shape[0], T + steps)
    with torch.no_grad():
        # prefill in two chunks (3 then 4 tokens), then one token at a time
        for s, e in [(0, 3), (3, T)] + [(t, t + 1) for t in range(T, T + steps)]:
            kw = {} if mask is None else dict(attention_mask=mask[:, :e], positions=pos[:, s:e])
            assert state.length == s
            logits, _ = model(ids[:, s:e], state=state, **kw)
            real = slice(None) if mask is None else mask[:, s:e].bool()
            got, want = logits, ref[:, s:e]
            if mask is not None:   # padding queries attend to nothing: compare real tokens only
                got, want = got[real], want[real]
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    assert state.length == T + steps
    assert all(sorted(vars(b.attn)) == attrs for b in model.blocks)      # the model holds no request state


@pytest.mark.parametrize("positions", POSITIONS)
def test_a_mask_of_the_new_tokens_reads_the_earlier_ones_from_the_state(positions):
    """With a state, the mask may cover the new tokens only: padding and positions of the held
    tokens come from ``state.valid`` (left padding, chunked prefill, then one token at a time)."""
    model = tiny(positions, 2)
    T, steps = 7, 5
    ids, mask = padded_batch([7, 3, 5], T + steps)
    mask[:, T:] = 1
    ref = full_logits(model, ids, mask)
    state = model.new_state(3, T + steps)
    with torch.no_grad():
        for s, e in [(0, 3), (3, T)] + [(t, t + 1) for t in range(T, T + steps)]:
            logits, _ = model(ids[:, s:e], state=state, attention_mask=mask[:, s:e])
            real = mask[:, s:e].bool()
            torch.testing.assert_close(logits[real], ref[:, s:e][real], atol=ATOL, rtol=0)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("positions", POSITIONS)
def test_static_decode_step_equals_full_recomputation(positions, layout):
    """The static path (tensor positions and write slots over the whole preallocated cache) gives
    the logits of a full uncached pass, with left padding and a sliding window too."""
    model = tiny(positions, LAYOUTS[layout], sliding_window=5 if positions == "rope" else None)
    T, steps = 7, 9
    ids, mask = padded_batch([7, 3, 5], T + steps)
    mask[:, T:] = 1
    ref = full_logits(model, ids, mask)
    pos = positions_of(mask)
    state = model.new_state(3, T + steps + 4, static=True)   # larger than needed: the rest stays masked
    with torch.no_grad():
        prefill(model, ids[:, :T], state, attention_mask=mask[:, :T])
        for t in range(T, T + steps):
            assert torch.equal(state.index, torch.full((3,), t))     # each row writes at its own tensor index
            logits = decode_step(model, ids[:, t:t + 1], state, positions=pos[:, t:t + 1])
            torch.testing.assert_close(logits, ref[:, t], atol=ATOL, rtol=0)


@pytest.mark.parametrize("positions", POSITIONS)
def test_left_padded_rows_equal_each_prompt_alone(positions):
    model = tiny(positions, 2)
    ids, mask = padded_batch([6, 2, 4], 6)
    batched = full_logits(model, ids, mask)
    for i, n in enumerate([6, 2, 4]):
        alone = full_logits(model, ids[i:i + 1, 6 - n:], None)
        torch.testing.assert_close(batched[i, 6 - n:], alone[0], atol=ATOL, rtol=0)


def test_sliding_window_cached_equals_full():
    model = tiny("rope", 2, sliding_window=4)
    ids = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(3))
    ref = full_logits(model, ids, None)
    state = model.new_state(2, 12)
    with torch.no_grad():
        out = [model(ids[:, :5], state=state)[0]] + [model(ids[:, t:t + 1], state=state)[0] for t in range(5, 12)]
    torch.testing.assert_close(torch.cat(out, 1), ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_bytes_equal_formula_and_tensors(layout, dtype):
    model = tiny("rope", LAYOUTS[layout])
    c = model.config
    state = model.new_state(3, 20, dtype=dtype)
    caches = state.layers
    elem = torch.finfo(dtype).bits // 8
    formula = 2 * c.n_layers * 20 * c.n_kv_heads * c.head_dim * elem * 3
    assert state.nbytes == formula == kv_cache_bytes(c, 20, 3, elem)
    assert sum(t.nbytes for cache in caches for t in (cache.k, cache.v)) == formula
    assert caches[0].k.shape == (3, c.n_kv_heads, 20, c.head_dim) and caches[0].k.dtype == dtype
    # GQA/MQA shrink the cache by n_heads / n_kv_heads against MHA
    assert formula * c.n_kv_groups == 2 * c.n_layers * 20 * c.n_heads * c.head_dim * elem * 3


def test_update_writes_in_place_and_returns_views():
    cache = KVCache(2, 2, 10, 4)
    k_ptr, v_ptr = cache.k.data_ptr(), cache.v.data_ptr()
    k, v = torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4)
    k_all, v_all = cache.update(0, k, v)
    assert k_all.shape == (2, 2, 3, 4) and torch.equal(k_all, k) and torch.equal(v_all, v)
    k2 = torch.randn(2, 2, 1, 4)
    k_all, v_all = cache.update(3, k2, k2)
    assert k_all.shape == (2, 2, 4, 4) and torch.equal(k_all[:, :, 3:], k2)
    assert k_all.data_ptr() == k_ptr and v_all.data_ptr() == v_ptr == cache.v.data_ptr()
    assert cache.k.data_ptr() == k_ptr                   # never reallocated


def test_update_past_capacity_raises():
    cache = KVCache(1, 1, 4, 2)
    with pytest.raises(ValueError, match="larger max_len"):
        cache.update(3, torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2))


def test_inference_state_map_moves_rows_of_every_layer_and_honours_batch_dims():
    from tformer.mixers.kv_cache import KVCache
    from tformer.models.state import InferenceState

    class Transposed:                                    # a layer state with its rows on dimension 1
        BATCH_DIMS = {"h": 1}

        def __init__(self):
            self.h = torch.arange(12.0).view(4, 3)       # (features, B)
            self.scale = 2.0

    cache = KVCache(3, 2, 5, 4)
    cache.k.copy_(torch.randn_like(cache.k))
    state = InferenceState([cache, None, Transposed()], batch_size=3, max_len=5)
    state.length, state.valid[1, :2] = 2, True
    rep = state.map(lambda t: t.repeat_interleave(2, dim=0))
    assert rep.batch_size == 6 and rep.length == 2 and rep.layers[1] is None
    assert torch.equal(rep.layers[0].k, cache.k.repeat_interleave(2, 0)) and rep.layers[0].max_len == 5
    assert torch.equal(rep.layers[2].h, state.layers[2].h.repeat_interleave(2, 1)) and rep.layers[2].scale == 2.0
    assert torch.equal(rep.valid, state.valid.repeat_interleave(2, 0)) and state.layers[0].k.shape[0] == 3
    Transposed.BATCH_DIMS = {}                           # undeclared: dimension 0 has 4 rows, not 3
    with pytest.raises(ValueError, match="Transposed.h of shape \\(4, 3\\) has no batch dimension 0"):
        state.map(lambda t: t)
