"""Whole models whose layers use the efficient mixers: training, generation with a state (eager and
static) against recomputation without one, checkpoints, hybrid stacks, accounting.

References: the same model without an inference state (full recomputation every step) and the model
before save/load; tformer.accounting against the parameters the modules really hold.
"""

import pytest
import torch

from tformer.accounting import count_parameters
from tformer.checkpoint import load_model, save_model
from tformer.config import TransformerConfig
from tformer.generation.generate import generate
from tformer.models import build_model
from tformer.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

DECODERS = {
    "longformer": {"window": 6},
    "performer": {"features": 16, "redraw_interval": 0},
}
ENCODERS = {
    "longformer": {"window": 4, "global_positions": [0]},
    "bigbird": {"block_size": 4, "num_random_blocks": 1},
    "performer": {"features": 16},
    "linformer": {"k": 8},
}


def _model(mixer, options, causal=True, **kw):
    torch.manual_seed(0)
    c = TransformerConfig(vocab_size=50, context_length=48, n_layers=2, d_model=32, n_heads=4, n_kv_heads=2,
                          positions="rope", causal=causal, mixer=mixer, mixer_options={m: options.get(m, options)
                                                                                        for m in ([mixer] if isinstance(mixer, str) else set(mixer) - {"attention"})},
                          **kw)
    return build_model(c).eval()


@pytest.mark.parametrize("mixer", list(DECODERS))
def test_generation_with_state_equals_recomputation(mixer):
    model = _model(mixer, DECODERS[mixer])
    prompt = torch.randint(0, 50, (2, 9))
    slow = generate(model, prompt, 20, temperature=0, use_cache=False)
    fast = generate(model, prompt, 20, temperature=0)
    static = generate(model, prompt, 20, temperature=0, static=True)
    chunked = generate(model, prompt, 20, temperature=0, prefill_chunk=4)
    assert torch.equal(slow, fast) and torch.equal(slow, static) and torch.equal(slow, chunked)


@pytest.mark.parametrize("mixer", list(DECODERS))
def test_left_padded_batch_equals_each_prompt_alone(mixer):
    model = _model(mixer, DECODERS[mixer])
    a, b = torch.randint(0, 50, (1, 9)), torch.randint(0, 50, (1, 6))
    ids = torch.cat([a, torch.cat([torch.zeros(1, 3, dtype=torch.long), b], 1)])
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0
    both = generate(model, ids, 8, temperature=0, attention_mask=mask)
    assert torch.equal(both[0, 9:], generate(model, a, 8, temperature=0)[0, 9:])
    assert torch.equal(both[1, 9:], generate(model, b, 8, temperature=0)[0, 6:])
    assert torch.equal(both, generate(model, ids, 8, temperature=0, attention_mask=mask, static=True))


def test_longformer_global_tokens_are_counted_among_real_tokens():
    """A left-padded row marks the same tokens global as the row alone (positions follow the mask)."""
    model = _model("longformer", {"window": 3, "global_positions": [0, 2]})
    ids = torch.randint(1, 50, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    with torch.no_grad():
        both, alone = model(ids, attention_mask=mask)[0], model(ids[1:, 4:])[0]
    torch.testing.assert_close(both[1, 4:], alone[0], atol=1e-5, rtol=0)


def test_hybrid_stack_and_accounting():
    model = _model(["longformer", "attention"], {"window": 6})
    assert count_parameters(model.config).total == sum(p.numel() for p in model.parameters())
    for mixer, options in ENCODERS.items():
        enc = _model(mixer, options, causal=False)
        assert count_parameters(enc.config).total == sum(p.numel() for p in enc.parameters()), mixer
        out = enc(torch.randint(0, 50, (2, 40)), attention_mask=torch.ones(2, 40, dtype=torch.long))
        assert out.shape == (2, 40, 32) and torch.isfinite(out).all()


@pytest.mark.parametrize("mixer,causal", [("longformer", True), ("performer", True), ("bigbird", False),
                                          ("linformer", False)])
def test_checkpoint_round_trip(tmp_path, mixer, causal):
    model = _model(mixer, (DECODERS if causal else ENCODERS)[mixer], causal=causal)
    ids = torch.randint(0, 50, (2, 40))
    before = model(ids)[0] if causal else model(ids)
    save_model(tmp_path / "m", model)
    again = load_model(tmp_path / "m").eval()
    after = again(ids)[0] if causal else again(ids)
    assert again.config.mixer == mixer and torch.equal(before, after)


def test_a_longformer_decoder_trains_through_the_trainer(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("abcdefghijklmnopqrstuvwxyz " * 200)
    settings = dict(n_layers=1, d_model=32, n_heads=2, context_length=16, batch_size=4, eval_batches=2,
                    log_interval=1, sample_tokens=0, progress=False, threads=1, precision="fp32",
                    data=str(path), out_dir=str(tmp_path / "run"), cache_dir=str(tmp_path / "cache"),
                    max_steps=60, lr=1e-2, min_lr=1e-3, warmup_steps=5, eval_interval=60,
                    mixer="longformer", mixer_options='{"longformer": {"window": 4}}')
    result = Trainer.create(settings, log=lambda m: None).fit()
    losses = [r["loss"] for r in result["history"] if "loss" in r]
    assert losses[0] > 2.5 and losses[-1] < 0.5                   # a window of 4 is enough for this cycle
    model = load_model(tmp_path / "run").eval()
    assert model.config.mixer == "longformer"
    out = generate(model, torch.tensor([[1, 2, 3]]), 10, temperature=0)
    assert out.shape == (1, 13)


def test_forward_makes_no_host_sync(monkeypatch):
    """Longformer's global tokens are bounded by the config, so the kernel reads nothing back."""
    models = [_model("longformer", {"window": 3, "global_positions": [0, 2]}), _model("longformer", {"window": 3}),
              _model("performer", DECODERS["performer"])]
    ids = torch.randint(1, 50, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0

    def refuse(*a, **k):
        raise AssertionError("a host sync in forward")
    for name in ("item", "__int__", "__float__", "__bool__", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    with torch.no_grad():
        for model in models:
            model(ids, attention_mask=mask)


def test_longformer_global_attention_mask_equals_fixed_global_positions():
    """A per-call global mask marking positions 0 and 7 gives what the same weights give with
    global_positions=[0, 7] fixed in the config (float32, 1e-6); the accounting counts the global
    projections that global_inputs builds; a mask where no layer can use it is one InputError."""
    from tformer.errors import InputError

    fixed = _model("longformer", {"window": 4, "global_positions": [0, 7]}, causal=False)
    given = _model("longformer", {"window": 4, "global_inputs": True}, causal=False)
    given.load_state_dict(fixed.state_dict())
    assert count_parameters(given.config).total == sum(p.numel() for p in given.parameters())
    ids = torch.randint(0, 50, (2, 20))
    glob = torch.zeros(2, 20, dtype=torch.long)
    glob[:, [0, 7]] = 1
    with torch.no_grad():
        torch.testing.assert_close(given(ids, global_attention_mask=glob), fixed(ids), atol=1e-6, rtol=1e-6)
        assert not torch.allclose(given(ids), fixed(ids), atol=1e-3)               # no mask: no global token
    plain = _model("longformer", {"window": 4}, causal=False)
    with pytest.raises(InputError, match="global_inputs"):
        plain(ids, global_attention_mask=glob)
    with pytest.raises(InputError, match="Longformer layers"):
        _model("linformer", {"k": 8}, causal=False)(ids, global_attention_mask=glob)
