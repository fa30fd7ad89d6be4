"""The claims added after the first eight: their helpers against independent references, and checks
that fail on measurements contradicting the claim (a criterion that cannot fail is a defect)."""

import math

import numpy as np
import pytest
import torch

from tformer.claims import all_claims, get_claims, verdict_of
from tformer.claims.catalog import (c03_position_symmetry as c03, c09_efficient_attention as c09,
                                    c12_mamba_selective as c12, c13_kv_cache_crossover as c13,
                                    c14_parallel_depth as c14, c15_decoder_scaling as c15)
from tformer.config import TransformerConfig
from tformer.models import build_model
from tformer.nn.positions import sinusoidal_table


def test_the_registry_holds_at_least_fifteen_claims_with_both_sizes():
    claims = all_claims()
    assert len(claims) >= 15
    assert len({c.order for c in claims}) == len(claims)                       # one place each in the report
    for c in claims:
        assert c.notes and set(c.sizes) == {"quick", "full"}


def test_sinusoidal_rotation_composes_and_matches_the_table():
    """M_j M_k = M_{j+k} (rotations by kω add), and M_k maps the table's rows k apart (float32 table: 1e-6)."""
    a, b = c03.rotation(16, 3), c03.rotation(16, 5)
    assert torch.allclose(a @ b, c03.rotation(16, 8), atol=1e-12)
    table = sinusoidal_table(200, 16).double()
    assert (table[:150] @ a.T - table[3:153]).abs().max() < 1e-6
    # a wrong offset is not the map
    assert (table[:150] @ c03.rotation(16, 4).T - table[3:153]).abs().max() > 1e-2


def test_power_fit_recovers_a_known_exponent_and_its_interval_covers_it():
    d = np.geomspace(1e3, 1e6, 12)
    rng = np.random.default_rng(1)
    exact = c15.power_fit(d, 7.0 * d ** -0.2, n_boot=50)
    assert exact["alpha"] == pytest.approx(0.2, abs=1e-9) and exact["r2"] == pytest.approx(1.0)
    noisy = c15.power_fit(d, 7.0 * d ** -0.2 * np.exp(rng.normal(0, 0.01, 12)), n_boot=300)
    lo, hi = noisy["alpha_ci"]
    assert lo < 0.2 < hi and hi - lo < 0.05
    flat = c15.power_fit(d, np.full(12, 3.0) * np.exp(rng.normal(0, 0.01, 12)), n_boot=300)
    claim = get_claims(["decoder-scaling"])[0]
    m = {"fit": flat, "val_loss": 3.2, "unigram": 3.1}
    assert verdict_of(claim.checks(m)) == "not reproduced"


def test_unigram_entropy_of_a_uniform_source_is_ln_256():
    assert c15.unigram_entropy(np.arange(256, dtype=np.uint8).repeat(3)) == pytest.approx(math.log(256))


def test_lstm_width_counts_the_lstm_parameters_pytorch_allocates():
    h = c14.lstm_width(100_000, 256, 2)
    model = c14.LSTMLM(256, h, 2)
    assert sum(p.numel() for p in model.parameters()) == 256 * h + 2 * (8 * h * h + 8 * h)


def test_crossover_bisection_against_the_closed_form_on_allocated_states():
    cfg = TransformerConfig(vocab_size=64, n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, context_length=16)
    model = build_model(cfg)
    n = c13.crossover(model, 2, torch.float32, 10_000)
    params = sum(p.numel() for p in model.parameters())
    assert n == math.floor(params / (2 * 2 * 2 * 8 * 2)) + 1
    assert model.new_state(2, n, torch.float32).nbytes > c13.weight_bytes(model) >= model.new_state(2, n - 1).nbytes


def test_kv_crossover_checks_fail_when_the_cache_is_small():
    claim = get_claims(["kv-cache-crossover"])[0]
    shape = {"name": "x", "layers": 2, "kv_heads": 8, "heads": 8, "head_dim": 8, "params": 1000, "weight_bytes": 10**12,
             "per_token": 512, "batches": {"1": {"formula": 10.0, "measured": 99, "state_bytes": 1, "formula_bytes": 2},
                                           "8": {"formula": 1.0, "measured": 99, "state_bytes": 1, "formula_bytes": 2}}}
    m = {"shapes": [shape, {**shape, "kv_heads": 2}, {**shape, "kv_heads": 1}, shape], "dtype": "bfloat16",
         "probe_tokens": 8, "context": 8192}
    assert verdict_of(claim.checks(m)) == "not reproduced"


def test_efficient_attention_checks_fail_when_sparse_attention_is_quadratic_and_fast():
    claim = get_claims(["efficient-attention"])[0]
    lengths = [512, 1024]
    quad = {"512": 1.0, "1024": 4.0}
    seconds = {name: dict(quad) for name in (*c09.EXACT, *c09.SPARSE, *c09.LINEAR)}
    for name in c09.SPARSE:
        seconds[name] = {"512": 0.1, "1024": 0.4}
    m = {"lengths": lengths, "seconds": seconds, "favor_error": 0.01, "majority": 10.0,
         "listops": {"attention": 20.0, "longformer": 30.0, "bigbird": 20, "performer": 20, "linformer": 20}}
    assert verdict_of(claim.checks(m)) == "not reproduced"
    assert c09.slope([512, 1024, 2048], [1.0, 4.0, 16.0]) == pytest.approx(2.0)


def test_mamba_checks_fail_on_an_lti_that_copies_and_a_quadratic_scan():
    claim = get_claims(["mamba-selective"])[0]
    m = {"copying": {"selective": {"accuracy": 0.95, "losses": [1.0]}, "lti": {"accuracy": 0.95, "losses": [1.0]}},
         "induction": {"mamba": {"32": 1.0, "256": 0.1}, "attention": {"32": 1.0, "256": 0.1}}, "train_len": 32,
         "forward": {"256": 1.0, "512": 4.0, "1024": 16.0}}
    assert c12.exponent(m["forward"]) == pytest.approx(2.0)
    assert verdict_of(claim.checks(m)) == "not reproduced"


def test_parallel_depth_checks_fail_when_the_lstm_is_faster():
    claim = get_claims(["parallel-depth"])[0]
    rows = [{"T": t, "transformer_s": 1e-4 * t * t, "lstm_s": 0.001 * t, "transformer_tok_s": 8 / (1e-4 * t),
             "lstm_tok_s": 8000.0} for t in (32, 128)]
    m = {"params": {"transformer": 1000, "lstm": 2000}, "rows": rows}
    assert verdict_of(claim.checks(m)) == "not reproduced"


def test_chinchilla_sweep_check_fails_on_kaplans_exponent():
    claim = get_claims(["chinchilla-tokens"])[0]
    m = claim.run.__globals__                                         # the module's constants, no sweep run
    measured = {"laws": {"Besiroglu 2024": {"tokens_per_param": 1.0}, "Kaplan 2020": {"tokens_per_param": 1.0},
                         "Hoffmann 2022": {"tokens_per_param": 1.0}},
                "gopher_n_opt": m["GOPHER"][0], "law_loss": {"chinchilla": 2.1, "gopher": 2.0, "gpt3": 2.0},
                "fit": {"a": 0.73, "a_ci": [0.71, 0.75]}}
    assert verdict_of(claim.checks(measured)) == "not reproduced"


def test_bahdanau_checks_fail_without_alignment_or_gain():
    claim = get_claims(["bahdanau-attention"])[0]
    bucket = [{"lengths": "1-10", "bleu": 50.0}, {"lengths": ">10", "bleu": 40.0}]
    m = {"models": {"bahdanau": {"tau": 0.0, "by_length": bucket}, "rnn-encoder-decoder": {"by_length": bucket}}}
    assert verdict_of(claim.checks(m)) == "not reproduced"


def test_pre_post_ln_gradients_use_the_analysis_setting_and_its_checks_can_fail():
    from tformer.claims.catalog import c05_pre_post_ln as c05

    config = c05.CLAIM.sizes["quick"]
    cfg = c05._analysis_config("post", config, 3)
    assert (cfg.d_ff, cfg.activation, cfg.tie_embeddings) == (cfg.d_model, "relu", False)
    claim = get_claims(["pre-vs-post-ln"])[0]
    flat = {"grads": {"post": [1.0, 1.0, 1.0], "pre": [1.0, 0.2, 0.1]}, "depths": [2, 4],
            "last_by_depth": {"post": [1.0, 5.0], "pre": [1.0, 1.0]}, "lr": 5e-3,
            "runs": {"pre, no warm-up": {"val_loss": 2.5, "losses": []},
                     "post, no warm-up": {"val_loss": 2.2, "losses": []},
                     "post, warm-up": {"val_loss": 2.9, "losses": []}}}
    assert verdict_of(claim.checks(flat)) == "not reproduced"
