"""Generation API: cache on/off agreement, batching, sampling filters, stop tokens/strings,
streaming and argument validation. Models are tiny (d=32, 2 layers, vocab 61)."""

import pytest
import torch

from tformer import DecoderLM, TransformerConfig
from tformer.generation.generate import generate, generate_tokens
from tformer.generation.sampling import filter_logits, sample
from tformer.generation.text import generate_text, left_pad, stream_text
from tformer.tokenizers import CharTokenizer

POSITIONS = ["none", "learned", "sinusoidal", "rope", "alibi"]
CHARS = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456 .,")  # 61 characters


def tiny(positions="learned", n_kv_heads=2, context_length=48, seed=0, **kw):
    torch.manual_seed(seed)
    c = TransformerConfig(vocab_size=len(CHARS), context_length=context_length, n_layers=2, d_model=32,
                          n_heads=4, n_kv_heads=n_kv_heads, positions=positions, **kw)
    model = DecoderLM(c).eval()
    with torch.no_grad():  # sharper distributions than the 0.02 init, so greedy has no near-ties
        model.lm_head.weight.mul_(20)
    return model


TOK = CharTokenizer(CHARS)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("positions", POSITIONS)
@pytest.mark.parametrize("n_kv_heads", [4, 2, 1], ids=["MHA", "GQA", "MQA"])
def test_greedy_same_tokens_with_and_without_cache(positions, n_kv_heads):
    model = tiny(positions, n_kv_heads)
    ids = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(1))
    cached = generate(model, ids, 12, temperature=0)
    uncached = generate(model, ids, 12, temperature=0, use_cache=False)
    chunked = generate(model, ids, 12, temperature=0, prefill_chunk=4)
    assert cached.shape == (2, 21)
    assert torch.equal(cached, uncached) and torch.equal(cached, chunked)


def test_chunked_prefill_of_a_left_padded_batch_equals_uncached():
    model = tiny("rope")
    ids, mask = left_pad([[1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 11, 12, 13]])
    ref = generate(model, ids, 10, temperature=0, attention_mask=mask, use_cache=False)
    for kw in (dict(prefill_chunk=2), dict(prefill_chunk=4, static=True)):
        assert torch.equal(generate(model, ids, 10, temperature=0, attention_mask=mask, **kw), ref)


@pytest.mark.parametrize("overflow", ["window", "shift"])
@pytest.mark.parametrize("positions", ["learned", "alibi"])
def test_past_the_context_cached_equals_uncached(overflow, positions):
    model = tiny(positions, context_length=12)
    ids, mask = left_pad([[1, 2, 3, 4, 5], [6, 7]])
    kw = dict(temperature=0, attention_mask=mask, overflow=overflow)
    cached = generate(model, ids, 30, **kw)
    assert torch.equal(cached, generate(model, ids, 30, use_cache=False, **kw))
    alone = generate(model, ids[1:, 3:], 30, temperature=0, overflow=overflow)   # padding changes nothing
    assert torch.equal(cached[1, 3:], alone[0])


def test_window_overflow_is_nanogpt_crop():
    """Reference: nanoGPT's loop, written out: logits of the last ``context`` tokens, argmax, append."""
    model = tiny("learned", context_length=10)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    ref = ids
    with torch.no_grad():
        for _ in range(15):
            nxt = model(ref[:, -10:])[0][:, -1].argmax(-1, keepdim=True)
            ref = torch.cat([ref, nxt], dim=1)
    assert torch.equal(generate(model, ids, 15, temperature=0), ref)


@pytest.mark.parametrize("positions", ["learned", "rope", "alibi"])
def test_shift_overflow_matches_its_written_out_definition(positions):
    """Reference for overflow="shift", written out without a cache: once the window would pass the
    context, it restarts at the last ``context // 2`` tokens (positions from 0); the model sees the window."""
    torch.manual_seed(0)  # init_std 0.3: context-dependent predictions, so "shift" and "window" differ here
    model = DecoderLM(TransformerConfig(vocab_size=61, context_length=10, n_layers=2, d_model=32, n_heads=4,
                                        n_kv_heads=2, positions=positions, init_std=0.3)).eval()
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    assert not torch.equal(generate(model, ids, 25, temperature=0, overflow="shift"),
                           generate(model, ids, 25, temperature=0, overflow="window"))
    ref, start = ids, 0
    with torch.no_grad():
        for _ in range(25):
            if ref.shape[1] - start > 10:
                start = ref.shape[1] - 10 // 2
            nxt = model(ref[:, start:])[0][:, -1].argmax(-1, keepdim=True)
            ref = torch.cat([ref, nxt], dim=1)
    assert torch.equal(generate(model, ids, 25, temperature=0, overflow="shift"), ref)


@pytest.mark.parametrize("positions", POSITIONS)
@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.9, top_k=20, top_p=0.9, seed=7)],
                         ids=["greedy", "sampled"])
def test_batched_generation_equals_one_by_one(positions, sampling):
    model = tiny(positions)
    prompts = [[3, 14, 15, 9, 2, 6, 5], [35, 8], [9, 7, 9, 3]]
    ids, mask = left_pad(prompts)
    batched = generate(model, ids, 12, attention_mask=mask, **sampling)
    for i, p in enumerate(prompts):
        alone = generate(model, torch.tensor([p]), 12, **sampling)
        assert batched[i, ids.shape[1] - len(p):].tolist() == alone[0].tolist()


def test_seed_reproducible_and_sampling_varies():
    model = tiny()
    ids = torch.tensor([[1, 2, 3]])
    a = generate(model, ids, 15, temperature=1.5, seed=3)
    assert torch.equal(a, generate(model, ids, 15, temperature=1.5, seed=3))
    assert not torch.equal(a, generate(model, ids, 15, temperature=1.5, seed=4))
    # top_k=1 leaves only the argmax: sampling equals greedy
    assert torch.equal(generate(model, ids, 15, temperature=1.0, top_k=1, seed=5), generate(model, ids, 15, temperature=0))


def test_filter_logits_against_hand_computed_sets():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    logits = probs.log()
    kept = lambda out: torch.isfinite(out[0]).nonzero().flatten().tolist()
    assert kept(filter_logits(logits, top_k=2)) == [1, 3]
    assert kept(filter_logits(logits, top_p=0.7)) == [1, 3]          # 0.5 < 0.7, 0.5+0.3 reaches it
    assert kept(filter_logits(logits, top_p=0.4)) == [1]             # the top token always survives
    assert kept(filter_logits(logits, top_p=0.9)) == [1, 2, 3]
    assert kept(filter_logits(logits, top_p=1.0)) == [0, 1, 2, 3]
    # sampled frequencies follow the renormalised nucleus {0.5, 0.3} -> {0.625, 0.375}
    g = [torch.Generator().manual_seed(0)]
    draws = torch.stack([sample(logits, 1.0, top_p=0.7, generators=g) for _ in range(4000)])
    assert set(draws.flatten().tolist()) == {1, 3}
    assert abs((draws == 1).float().mean().item() - 0.625) < 0.03   # ~4 sigma


def test_stop_tokens_end_each_sequence_and_pad():
    model = tiny()
    ids = torch.tensor([[1, 2, 3]])
    free = generate(model, ids, 12, temperature=0)[0, 3:].tolist()
    stop = free[5]
    first = free.index(stop)
    out = generate(model, ids, 12, temperature=0, stop_tokens=[stop])
    assert out[0, 3:].tolist() == free[:first + 1]                   # stop token kept, then ends
    prompts = [[1, 2, 3], [4, 5]]
    bids, mask = left_pad(prompts)
    out = generate(model, bids, 20, temperature=0, attention_mask=mask, stop_tokens=[stop], pad_id=60)
    row = out[0, 3:].tolist()
    assert row[:first + 1] == free[:first + 1] and set(row[first + 1:]) <= {60}


def test_stop_strings_cut_exactly_and_streaming_matches():
    model = tiny()
    full = generate_text(model, TOK, "hello", 30, temperature=0)
    assert len(full) == 30
    stop = full[10:13]
    cut = full.find(stop)
    assert generate_text(model, TOK, "hello", 30, temperature=0, stop=[stop]) == full[:cut]
    assert generate_text(model, TOK, "hello", 30, temperature=0, stop=["not there", stop, full[cut + 1:]]) == full[:cut]
    for kwargs in [dict(), dict(stop=[stop]), dict(stop=["qqqqq"]), dict(temperature=0.8, seed=1, stop=[full[4:6]])]:
        kwargs = {"temperature": 0, **kwargs}
        pieces = list(stream_text(model, TOK, "hello", 30, **kwargs))
        assert "".join(pieces) == generate_text(model, TOK, "hello", 30, **kwargs)
        assert all(pieces)
    assert len(list(stream_text(model, TOK, "hello", 30, temperature=0))) > 1  # it streams, piece by piece


def test_batched_text_equals_alone_with_stop_strings():
    model = tiny()
    prompts = ["hello", "a", "The cat"]
    alone = [generate_text(model, TOK, p, 25, temperature=0) for p in prompts]
    stop = alone[1][3:5]
    batched = generate_text(model, TOK, prompts, 25, temperature=0, stop=[stop])
    assert batched == [a[:a.find(stop)] if stop in a else a for a in alone]


def _module_state(model):
    """Every module's attribute names and the identity of every tensor it holds."""
    return ({name: sorted(vars(m)) for name, m in model.named_modules()},
            {name: id(t) for name, t in list(model.named_parameters()) + list(model.named_buffers())})


def test_generation_leaves_the_model_alone_and_ignores_dropout():
    """The model is never switched to eval and holds no cache; inference mode turns dropout off,
    so a model in training mode with dropout generates what its eval copy generates."""
    model = tiny(dropout=0.3).train()
    ids = torch.tensor([[1, 2, 3]])
    before = _module_state(model)
    out = generate(model, ids, 8, temperature=0)
    assert model.training and _module_state(model) == before            # nothing attached, nothing replaced
    assert torch.equal(out, generate(model.eval(), ids, 8, temperature=0))


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.1), "temperature=-0.1 must be a finite number >= 0"),
    (dict(temperature=float("nan")), "temperature=nan must be a finite number >= 0"),
    (dict(temperature=float("inf")), "temperature=inf must be a finite number >= 0"),
    (dict(seed=-1), r"seed=-1 must be an integer in \[0, 2\*\*63\)"),
    (dict(colour="red"), r"unknown generation option\(s\) colour"),
    (dict(top_p=0.0), r"top_p=0.0 must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p=1.5 must be in \(0, 1\]"),
    (dict(top_k=0), "top_k=0 must be >= 1"),
    (dict(max_new_tokens=-1), "max_new_tokens=-1 must be >= 0"),
    (dict(prefill_chunk=0), "prefill_chunk=0 must be >= 1"),
    (dict(overflow="wrap"), "overflow='wrap' is not known"),
])
def test_bad_arguments_raise_their_message(kwargs, message):
    model = tiny()
    n = kwargs.pop("max_new_tokens", 3)
    with pytest.raises(ValueError, match=message):
        generate(model, torch.tensor([[1, 2]]), n, **kwargs)


def test_bad_prompts_raise_their_message():
    model = tiny(context_length=16)
    with pytest.raises(ValueError, match=r"17 tokens but the model's context is 16 \(config.context_length\)"):
        generate(model, torch.zeros(1, 17, dtype=torch.long), 1)
    with pytest.raises(ValueError, match="prompt is empty"):
        generate(model, torch.zeros(1, 0, dtype=torch.long), 1)
    with pytest.raises(ValueError, match="prompt is empty"):
        generate_text(model, TOK, "", 3)
    with pytest.raises(ValueError, match="left padding"):
        generate(model, torch.ones(2, 3, dtype=torch.long), 1, attention_mask=torch.tensor([[1, 1, 0], [1, 1, 1]]))
    with pytest.raises(ValueError, match="top_k=0"):
        list(stream_text(model, TOK, "abc", 3, top_k=0))


def test_one_check_of_the_options_names_them_as_the_api_or_the_command_line_does():
    from tformer.generation.generate import GenerationOptions
    from tformer.generation.sampling import check_max_new_tokens, check_sampling

    for flags, names in ((False, ("temperature=nan", "top_k=0", "top_p=1.5", "seed=-1", "max_new_tokens=-1")),
                         (True, ("--temperature nan", "--top-k 0", "--top-p 1.5", "--seed -1", "--max-new-tokens -1"))):
        bad = [dict(temperature=float("nan")), dict(top_k=0), dict(top_p=1.5), dict(seed=-1)]
        for kw, name in zip(bad, names):
            with pytest.raises(ValueError, match=name):
                check_sampling(**{"temperature": 1.0, "top_k": None, "top_p": None, **kw}, flags=flags)
        with pytest.raises(ValueError, match=names[-1]):
            check_max_new_tokens(-1, flags=flags)
    with pytest.raises(ValueError, match="between 0 and 8"):
        check_max_new_tokens(9, 8)
    check_max_new_tokens(8, 8)
    with pytest.raises(ValueError, match=r"seed=18446744073709551616 must be an integer in \[0, 2\*\*63\)"):
        GenerationOptions(seed=2**64)
    with pytest.raises(ValueError, match="max_new_tokens=-1"):
        generate(tiny(), torch.tensor([[1, 2]]), -1)


def test_cli_generate_prints_text_and_speed(tmp_path, capsys):
    from tformer.checkpoint import save_model
    from tformer.cli import main

    model = tiny()
    save_model(tmp_path, model)
    TOK.save(tmp_path / "tokenizer.json")
    base = ["generate", "--ckpt", str(tmp_path), "--prompt", "hello", "--max-new-tokens", "12", "--temperature", "0"]
    assert main(base) == 0
    out, err = capsys.readouterr()
    assert out.rstrip("\n") == generate_text(model, TOK, "hello", 12, temperature=0)
    assert "12 tokens in" in err and "tokens/s" in err
    assert main(base + ["--stream", "--dtype", "int8"]) == 0
    assert "tokens/s (int8, KV cache" in capsys.readouterr().err
    assert main(base + ["--top-p", "1.5"]) == 2
    assert "--top-p 1.5 must be in (0, 1]" in capsys.readouterr().err   # checked up front, naming the flag


def test_interleaved_generations_on_one_model_each_equal_alone():
    """Per-request state: two generations on one model object, advanced step by step in turn (two
    iterators) or at once from two threads, each give exactly the tokens they give alone."""
    import threading

    from tformer.generation.generate import generate_tokens

    model = tiny("rope")
    a_ids, b_ids = torch.tensor([[1, 2, 3, 4]]), torch.tensor([[9, 8]])
    a_opts, b_opts = dict(temperature=0.9, seed=1), dict(temperature=0, overflow="shift")
    alone_a, alone_b = generate(model, a_ids, 30, **a_opts), generate(model, b_ids, 60, **b_opts)
    steps_a = generate_tokens(model, a_ids, 30, **a_opts)
    steps_b = generate_tokens(model, b_ids, 60, **b_opts)
    got_a, got_b = [], []
    for i in range(60):                                   # a, b, a, b, ... then b alone
        if i < 30:
            got_a.append(next(steps_a))
        got_b.append(next(steps_b))
    assert torch.equal(torch.cat([a_ids, torch.stack(got_a, 1)], 1), alone_a)
    assert torch.equal(torch.cat([b_ids, torch.stack(got_b, 1)], 1), alone_b)

    results = {}
    threads = [threading.Thread(target=lambda k=k, ids=ids, o=o, n=n: results.__setitem__(k, generate(model, ids, n, **o)))
               for k, ids, o, n in (("a", a_ids, a_opts, 30), ("b", b_ids, b_opts, 60))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert torch.equal(results["a"], alone_a) and torch.equal(results["b"], alone_b)


@pytest.mark.parametrize("overflow", ["window", "shift"])
def test_static_decode_equals_eager_through_the_context_edge(overflow):
    model = tiny("rope", context_length=16)
    ids, mask = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]]), torch.tensor([[0, 0, 1, 1, 1], [1] * 5])
    eager = generate(model, ids, 30, temperature=0, attention_mask=mask, overflow=overflow)
    assert torch.equal(generate(model, ids, 30, temperature=0, attention_mask=mask, overflow=overflow, static=True),
                       eager)


def test_huge_max_new_tokens_allocates_nothing_up_front():
    steps = generate_tokens(tiny(), torch.tensor([[1, 2]]), 10**12, temperature=0)
    assert next(steps).shape == (1,)


def test_non_finite_logits_stop_generation_with_one_sentence():
    from tformer.errors import TformerError

    model = tiny()
    with torch.no_grad():
        model.blocks[0].ffn.down.weight.fill_(1e38)           # finite weights that overflow
    with pytest.raises(TformerError, match="non-finite logits"):
        generate(model, torch.tensor([[1, 2]]), 4, temperature=0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_the_finite_check_finds_one_bad_logit_and_keeps_huge_finite_ones(bad):
    """The per-step check sums the logits (one vectorised pass) and falls back to the element-wise test
    when the sum is not finite: one NaN or inf among 50,257 logits is caught, and finite logits whose sum
    overflows float32 still pass."""
    from tformer.generation.generate import _finite

    logits = torch.randn(2, 50257)
    assert _finite(logits)
    logits[1, 31337] = bad
    assert not _finite(logits)
    assert _finite(torch.full((1, 8), 3e38))                  # the sum is inf, every logit finite


def test_a_temperature_below_the_floor_is_greedy():
    """Issue 29: dividing logits by a denormal temperature (1e-45) made them inf and the softmax NaN.
    Below MIN_TEMPERATURE (1e-6) sampling takes the argmax; at the floor it still samples finitely."""
    from tformer.generation.sampling import MIN_TEMPERATURE

    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0)) * 20
    gens = [torch.Generator().manual_seed(i) for i in range(8)]
    for t in (1e-45, 5e-324, 1e-30, 0.99 * MIN_TEMPERATURE):
        assert torch.equal(sample(logits, t, generators=gens), logits.argmax(-1))
        assert torch.equal(sample(logits, t, top_k=5, top_p=0.5), logits.argmax(-1))
    picked = sample(logits, MIN_TEMPERATURE, generators=gens)
    assert torch.equal(picked, logits.argmax(-1))          # the gaps here are far above 1e-6
    torch.manual_seed(0)
    model = DecoderLM(TransformerConfig(vocab_size=20, d_model=16, n_heads=2, n_layers=1, context_length=16)).eval()
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(generate(model, ids, 5, temperature=1e-45), generate(model, ids, 5, temperature=0))
