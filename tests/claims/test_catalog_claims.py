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
         "forward": {"256": 1.0, "512": 4.0, "1024": 16.0},
         # decode cost growing with the context and a state that grows: not constant-cost generation
         "decode": {name: {"params": 1, "by_position": {"64": {"fastest": 1.0, "median": 1.0, "state_bytes": 10},
                                                         "4096": {"fastest": 9.0, "median": 9.0, "state_bytes": 640}}}
                    for name in ("mamba", "transformer")},
         "train": {"mamba": {"val_loss": 2.0, "tokens_per_s": 1.0, "params": 1, "curve": []},
                   "transformer": {"val_loss": 1.5, "tokens_per_s": 1.0, "params": 1, "curve": []}}}
    assert c12.exponent(m["forward"]) == pytest.approx(2.0)
    assert c12.decode_growth(m)["mamba"] == {"time": 9.0, "state": 64.0}
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


def test_pre_post_ln_measures_the_decoder_of_an_encoder_decoder():
    """The by-layer gradients come from the paper's 6-6 translation architecture: one W^{FC2} per encoder and
    decoder layer, split by side in layer order."""
    from tformer.claims.catalog import c05_pre_post_ln as c05
    from tformer.claims.common import byte_corpus

    config = c05.CLAIM.sizes["quick"]
    cfg = c05._seq2seq_config("post", config, 2)
    assert (cfg.model, cfg.encoder_layers, cfg.n_layers, cfg.activation) == ("encoder-decoder", 2, 2, "relu")
    train, _ = byte_corpus(20_000)
    sides = c05.init_gradients("post", config, train, 2, "seq2seq")
    assert set(sides) == {"encoder", "decoder", "decoder_rms"} and len(sides["encoder"]) == len(sides["decoder"]) == 2
    assert all(x > 0 for x in sides["encoder"] + sides["decoder"])
    # a Post-LN block's output is a LayerNorm's (weight 1, bias 0 at init): RMS 1 per token, up to eps
    assert sides["decoder_rms"] == pytest.approx([1.0, 1.0], abs=1e-3)
    assert list(c05.init_gradients("pre", config, train, 3)) == ["decoder", "decoder_rms"]
    # Pre-LN's stream only adds: each sublayer's output is summed onto it, so its RMS grows layer by layer
    pre = c05.init_gradients("pre", config, train, 3, "seq2seq")["decoder_rms"]
    assert pre[0] < pre[1] < pre[2]


def test_pre_post_ln_shared_embedding_is_vaswanis_scaled_matrix():
    """The encoder-decoder's one matrix (source, target, output head) after the claim's init: std d^-1/2, so the
    √d-scaled input is unit-variance and the tied head's logits stay O(1) (not the head's Xavier init, which
    left the input 1/d of unit variance)."""
    from tformer.claims.catalog import c05_pre_post_ln as c05
    from tformer.models import build_model

    config = {**c05.CLAIM.sizes["quick"], "grad": {**c05.CLAIM.sizes["quick"]["grad"], "d_model": 256}}
    torch.manual_seed(0)
    model = build_model(c05._seq2seq_config("pre", config, 2))
    c05._xavier(model)
    assert model.lm_head.weight is model.encoder.tok_emb.weight
    assert model.encoder.tok_emb.weight.std().item() == pytest.approx(256 ** -0.5, rel=0.02)
    ids = torch.randint(0, 256, (4, 32))
    assert model.decoder.tok_emb(ids).std().item() == pytest.approx(1.0, rel=0.05)    # ×√d on the way in
    logits, _ = model(ids, ids)
    assert 0.5 < logits.std().item() < 2.0


def test_real_model_claims_checks_fail_on_contradicting_measurements():
    rope = get_claims(["rope-relative-real"])[0]
    m = {"shifts": [1], "worst": {"1": [1e-2, 1e-3]}, "control": [0.0, 1e-4], "weights_error": 0.1,
         "prompts": 1, "layers": 2, "heads": 9, "kv_heads": 3}
    assert verdict_of(rope.checks(m)) == "not reproduced"
    gqa = get_claims(["gqa-cache-real"])[0]
    m = {"layers": 30, "heads": 9, "kv_heads": 3, "head_dim": 64, "element_bytes": 4, "capacities": [1, 2],
         "gqa_per_token": 138240.0, "mha_per_token": 138240.0, "weight_bytes": 1, "decode_error": 1.0, "prompts": 1}
    assert verdict_of(gqa.checks(m)) == "not reproduced"
    jw = get_claims(["attention-explanation-real"])[0]
    layer = {"grad": 0.9, "loo": 0.9}
    m = {"prompts": [{"tokens": 5, "grad_loo": 0.1, "layers": [layer, layer], "heads": [[layer], [layer]]}],
         "n_layers": 2, "n_heads": 1}
    assert verdict_of(jw.checks(m)) == "not reproduced"


def test_leave_one_out_batched_equals_one_forward_per_removed_token():
    from tformer.claims.catalog import c18_attention_explanation_real as c18

    torch.manual_seed(0)
    model = build_model(TransformerConfig(vocab_size=50, context_length=16, n_layers=2, d_model=32, n_heads=4,
                                          positions="rope")).eval()
    ids = torch.randint(0, 50, (1, 9))
    got = c18.leave_one_out(model, ids)
    with torch.no_grad():
        p = torch.softmax(model(ids)[0][0, -1].double(), -1)
        for j in range(8):
            q = torch.softmax(model(torch.cat([ids[:, :j], ids[:, j + 1:]], 1))[0][0, -1].double(), -1)
            assert got[j] == pytest.approx(float(0.5 * (q - p).abs().sum()), abs=1e-6)
    grad, target = c18.gradient_importance(model, ids)
    assert len(grad) == 9 and all(g >= 0 for g in grad) and 0 <= target < 50


def test_rope_scores_rebuilt_from_a_layer_input_match_its_attention_weights():
    from tformer.claims.catalog import c16_rope_relative_real as c16

    torch.manual_seed(0)
    model = build_model(TransformerConfig(vocab_size=50, context_length=64, n_layers=2, d_model=32, n_heads=4,
                                          n_kv_heads=2, positions="rope")).eval()
    ids = torch.randint(0, 50, (1, 10))
    maps = model.attention_maps(ids)
    for layer, (block, h) in enumerate(zip(model.blocks, c16.layer_inputs(model, ids))):
        s0 = c16.scores(block.attn, h, 0, 0)
        w = torch.softmax((s0 / block.attn.head_dim ** 0.5).masked_fill(~torch.ones(10, 10).bool().tril(), -math.inf), -1)
        assert (w - maps[layer]).abs().max() < 1e-5
        assert (c16.scores(block.attn, h, 30, 30) - s0).abs().max() < 1e-4 * s0.abs().max()
        assert (c16.scores(block.attn, h, 1, 0) - s0).abs().max() > 1e-2 * s0.abs().max()
