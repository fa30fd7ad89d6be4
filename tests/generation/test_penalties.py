"""The samplers against independent references on the same logits: transformers' logits processors
(repetition penalty, min-p, top-k, top-p, temperature, sequence bias), composed in llama.cpp's order for
the whole chain; llama.cpp's own samplers (llama-cpp-python, skipped where it is not installed) for
presence / frequency penalties and the chain. Tolerance: 1e-6 on logits and probabilities (float32)."""

from __future__ import annotations

import math

import pytest
import torch

from tformer.generation.penalties import History, Penalties, penalize
from tformer.generation.sampling import filter_logits, probabilities, sample

tl = pytest.importorskip("transformers.generation.logits_process")

V = 64


def logits_and_ids(seed: int = 0, B: int = 3, T: int = 12):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, V, generator=g) * 3, torch.randint(0, V, (B, T), generator=g)


def same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal -inf masks and finite values within 1e-6."""
    assert torch.equal(torch.isinf(a), torch.isinf(b))
    fin = torch.isfinite(a)
    assert torch.allclose(a[fin], b[fin], atol=1e-6, rtol=0)


@pytest.mark.parametrize("r", [1.3, 0.7, 2.0])
def test_repetition_penalty_equals_transformers(r):
    logits, ids = logits_and_ids()
    ref = tl.RepetitionPenaltyLogitsProcessor(r)(ids, logits.clone())
    same(penalize(logits, History(ids, V, penalties=Penalties(repetition=r))), ref)


def test_repetition_penalty_reads_generated_tokens_and_skips_padding():
    """History.add counts a generated token as seen; left padding (mask 0) is not a token (transformers
    on the unpadded rows)."""
    logits, ids = logits_and_ids(1, B=2, T=8)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    h = History(ids, V, mask, Penalties(repetition=1.5))
    new = torch.tensor([5, 9])
    h.add(new)
    out = penalize(logits, h)
    proc = tl.RepetitionPenaltyLogitsProcessor(1.5)
    same(out[0:1], proc(torch.cat([ids[0:1], new[0:1, None]], 1), logits[0:1].clone()))
    same(out[1:2], proc(torch.cat([ids[1:2, 3:], new[1:2, None]], 1), logits[1:2].clone()))


@pytest.mark.parametrize("m", [0.05, 0.2, 0.9])
def test_min_p_equals_transformers(m):
    logits, ids = logits_and_ids(2)
    same(filter_logits(logits, min_p=m), tl.MinPLogitsWarper(m)(ids, logits.clone()))


def test_top_k_top_p_temperature_equal_transformers():
    logits, ids = logits_and_ids(3)
    same(filter_logits(logits, top_k=7), tl.TopKLogitsWarper(7)(ids, logits.clone()))
    for p in (0.3, 0.8, 0.95):
        same(filter_logits(logits, top_p=p), tl.TopPLogitsWarper(p)(ids, logits.clone()))


def test_chain_is_llama_cpp_order_with_transformers_warpers():
    """probabilities() = softmax(temperature(min_p(top_p(top_k(logits))))): transformers' warpers composed
    in llama.cpp's order; transformers' own order (temperature first) gives another distribution."""
    logits, ids = logits_and_ids(4)
    T, k, p, m = 0.7, 20, 0.8, 0.05
    x = logits.clone()
    for w in (tl.TopKLogitsWarper(k), tl.TopPLogitsWarper(p), tl.MinPLogitsWarper(m), tl.TemperatureLogitsWarper(T)):
        x = w(ids, x)
    ours = probabilities(logits, T, k, p, m)
    assert torch.allclose(ours, torch.softmax(x, -1), atol=1e-6, rtol=0)
    y = logits.clone()
    for w in (tl.TemperatureLogitsWarper(T), tl.TopKLogitsWarper(k), tl.TopPLogitsWarper(p), tl.MinPLogitsWarper(m)):
        y = w(ids, y)
    assert not torch.equal(torch.isinf(x), torch.isinf(y))      # the order matters: the test can tell


def test_logit_bias_equals_sequence_bias():
    logits, ids = logits_and_ids(5)
    bias = ((3, -100.0), (10, 5.5), (63, 0.25))
    ref = tl.SequenceBiasLogitsProcessor({(t,): v for t, v in bias})(ids, logits.clone())
    same(penalize(logits, History(ids, V, penalties=Penalties(bias=bias))), ref)


def test_presence_and_frequency_by_hand():
    """OpenAI's definition, worked by hand: l - count * frequency - [count > 0] * presence, on generated
    tokens only (the prompt's tokens are not counted)."""
    logits = torch.zeros(1, 6)
    h = History([[4]], 6, penalties=Penalties(presence=0.5, frequency=0.25))
    for t in (1, 1, 2):
        h.add(torch.tensor([t]))
    out = penalize(logits, h)
    assert out[0].tolist() == [0.0, -1.0, -0.75, 0.0, 0.0, 0.0]


def test_rows_have_their_own_penalties_and_a_greedy_loop_is_broken():
    """Per-row options in one call equal each row alone; a huge bias against the argmax moves greedy off it."""
    logits, ids = logits_and_ids(6)
    opts = [Penalties(repetition=1.4), Penalties(), Penalties(frequency=1.0, bias=((0, 2.0),))]
    h = History(ids, V, penalties=opts)
    for t in (0, 5):
        h.add(torch.tensor([t, t, t]))
    together = penalize(logits, h)
    for b, o in enumerate(opts):
        hb = History(ids[b:b + 1], V, penalties=o)
        for t in (0, 5):
            hb.add(torch.tensor([t]))
        same(together[b:b + 1], penalize(logits[b:b + 1], hb))
    slots = History.rows(5, V)                   # the server's rows: one per slot, a subset penalised per step
    for b, o in enumerate(opts):
        slots.start(4 - b, ids[b].tolist(), o)
        slots.add(torch.tensor([0, 5]), torch.tensor([4 - b, 4 - b]))
    same(penalize(logits, slots, torch.tensor([4, 3, 2])), together)
    top = int(logits[0].argmax())
    banned = penalize(logits[:1], History(ids[:1], V, penalties=Penalties(bias=((top, -100.0),))))
    assert int(sample(banned, 0.0)[0]) != top


def test_generate_with_penalties_equals_transformers_generate(tmp_path):
    """tformer's generate with a repetition penalty, greedy, gives transformers' generate's tokens on the
    same random GPT-2 weights (converted with tformer's importer)."""
    transformers = pytest.importorskip("transformers")
    from tformer.generation.generate import generate
    from tformer.interop.hf import load_hf

    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=V,
                                                               n_positions=64)).eval()
    hf.save_pretrained(tmp_path)
    ours = load_hf(tmp_path).eval()
    ids = torch.tensor([[1, 2, 3, 1, 2, 3]])
    for kw in (dict(repetition_penalty=1.5), dict(repetition_penalty=0.8)):
        ref = hf.generate(ids, max_new_tokens=20, do_sample=False, pad_token_id=0, **kw)
        assert generate(ours, ids, 20, temperature=0, **kw).tolist() == ref.tolist()


# ------------------------------------------------------------------------- llama.cpp's own samplers
def llama_cpp_apply(logits: torch.Tensor, chain) -> dict[int, float]:
    """Apply llama.cpp samplers (a list of ``(sampler, tokens to accept)``) to one row of logits; return the
    surviving candidates' logits."""
    L = pytest.importorskip("llama_cpp")
    n = logits.shape[-1]
    data = (L.llama_token_data * n)(*[L.llama_token_data(i, float(v), 0.0) for i, v in enumerate(logits.tolist())])
    arr = L.llama_token_data_array(data, n, -1, False)
    for smpl, accepted in chain:
        for t in accepted:
            L.llama_sampler_accept(smpl, t)
        L.llama_sampler_apply(smpl, L.ctypes.byref(arr))
        L.llama_sampler_free(smpl)
    return {arr.data[i].id: arr.data[i].logit for i in range(arr.size)}


def test_penalties_equal_llama_cpp():
    """Repetition, frequency and presence together on the same generated tokens (an empty prompt, so
    tformer's prompt rule and llama.cpp's window read the same tokens)."""
    L = pytest.importorskip("llama_cpp")
    logits, _ = logits_and_ids(7, B=1)
    generated = [3, 3, 7, 11, 3, 50]
    rep, freq, pres = 1.3, 0.4, 0.6
    # (n_vocab, last_n) in this binding's signature; llama.cpp's C function reads last_n from the first
    # int: both set to the window, so either reading holds every generated token.
    smpl = L.llama_sampler_init_penalties(len(generated), len(generated), rep, freq, pres)
    ref = llama_cpp_apply(logits[0], [(smpl, generated)])
    h = History(torch.empty(1, 0, dtype=torch.long), V, penalties=Penalties(rep, pres, freq))
    for t in generated:
        h.add(torch.tensor([t]))
    ours = penalize(logits, h)[0]
    assert max(abs(ours[i].item() - v) for i, v in ref.items()) < 1e-5


def test_chain_equals_llama_cpp():
    L = pytest.importorskip("llama_cpp")
    logits, _ = logits_and_ids(8, B=1)
    T, k, p, m = 0.7, 20, 0.8, 0.05
    chain = [(L.llama_sampler_init_top_k(k), []), (L.llama_sampler_init_top_p(p, 1), []),
             (L.llama_sampler_init_min_p(m, 1), []), (L.llama_sampler_init_temp(T), [])]
    ref = llama_cpp_apply(logits[0], chain)
    ours = probabilities(logits, T, k, p, m)[0]
    assert set(ref) == set(torch.nonzero(ours).flatten().tolist())
    z = math.log(sum(math.exp(v) for v in ref.values()))
    assert max(abs(ours[i].item() - math.exp(v - z)) for i, v in ref.items()) < 1e-6


def test_a_ggufs_recommendations_are_read_and_a_flag_wins(tmp_path):
    """general.sampling.* (gguf-py's writer, llama.cpp's key names) become the commands' defaults; an option
    given on the command line wins over the file, the file over the command's own default."""
    import argparse

    import gguf
    import numpy as np

    from tformer.commands.generate import sampling_options
    from tformer.inference import sampling_defaults
    from tformer.interop.gguf_reader import GGUFFile

    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    K = gguf.Keys.General
    w.add_float32(K.SAMPLING_TEMP, 0.6)
    w.add_int32(K.SAMPLING_TOP_K, 20)
    w.add_float32(K.SAMPLING_MIN_P, 0.05)
    w.add_float32(K.SAMPLING_PENALTY_REPEAT, 1.1)
    w.add_tensor("x", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    found = sampling_defaults(GGUFFile(tmp_path / "m.gguf"))
    assert found == pytest.approx({"temperature": 0.6, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1})
    args = argparse.Namespace(temperature=None, top_k=5, top_p=None, min_p=None, repetition_penalty=None,
                              presence_penalty=0.0, frequency_penalty=0.3, logit_bias=["2=-100"], seed=1,
                              max_new_tokens=4)
    got = sampling_options(args, found, {"temperature": 0.8, "top_k": None, "top_p": 0.9})
    assert got.pop("logit_bias") == ((2, -100.0),)
    assert got == pytest.approx({"temperature": 0.6, "top_k": 5, "top_p": 0.9, "min_p": 0.05, "seed": 1,
                                 "repetition_penalty": 1.1, "presence_penalty": 0.0, "frequency_penalty": 0.3})
