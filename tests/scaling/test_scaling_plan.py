"""The planner: allocations against hand-computed cases, the config it picks against the built model,
memory against what PyTorch actually allocates and saves, and ``tformer plan`` end to end."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tformer.cli import main
from tformer.config import TransformerConfig
from tformer.errors import InputError
from tformer.models.decoder import DecoderLM
from tformer.scaling.laws import BESIROGLU, HOFFMANN, KAPLAN
from tformer.scaling.plan import (activation_bytes, allocate, config_near, measure_flops_per_second,
                                  training_memory)
from tformer.training.optim import make_optimizer

SRC = str(Path(__file__).resolve().parents[2] / "src")


def test_hoffmann_allocation_at_gophers_budget_by_hand():
    # G = (αA / βB)^(1/(α+β)) = (0.34·406.4 / (0.28·410.7))^(1/0.62) = 1.201572^1.612903 = 1.34471
    # a = β/(α+β) = 0.451613;  N = G (C/6)^a = 1.34471 · (9.6e22)^0.451613 = 3.2190e10;  D = 9.6e22 / N = 2.9823e12
    a = allocate(HOFFMANN, flops=5.76e23)
    assert HOFFMANN.G == pytest.approx(1.34471, rel=1e-5)
    assert a.n_params == pytest.approx(3.2190e10, rel=1e-4)
    assert a.n_tokens == pytest.approx(2.9823e12, rel=1e-4)
    assert a.tokens_per_param == pytest.approx(92.65, rel=1e-3)


def test_loss_of_chinchilla_70b_by_hand():
    # 1.69 + 406.4 / (7e10)^0.34 + 410.7 / (1.4e12)^0.28 = 1.69 + 406.4/4865.1 + 410.7/2516.0 = 1.93665
    assert HOFFMANN.loss(70e9, 1.4e12) == pytest.approx(1.93665, abs=2e-5)


def test_kaplan_allocation_at_one_pf_day_by_hand():
    # N = 1.3e9 · (8.64e19 / 8.64e19)^0.73 = 1.3e9;  D = 8.64e19 / (6 · 1.3e9) = 1.10769e10
    a = allocate(KAPLAN, flops=8.64e19)
    assert a.n_params == pytest.approx(1.3e9)
    assert a.n_tokens == pytest.approx(1.10769e10, rel=1e-5)
    assert a.loss is None and a.non_embedding
    # Ten times the compute: N grows 10^0.73 = 5.370x, D only 10^0.27 = 1.862x.
    b = allocate(KAPLAN, flops=8.64e20)
    assert b.n_params / a.n_params == pytest.approx(5.3703, rel=1e-4)
    assert b.n_tokens / a.n_tokens == pytest.approx(1.8621, rel=1e-4)


@pytest.mark.parametrize("law", [HOFFMANN, BESIROGLU, KAPLAN], ids=lambda x: x.name)
def test_planning_from_params_or_tokens_inverts_planning_from_flops(law):
    a = allocate(law, flops=3e21)
    assert allocate(law, params=a.n_params).flops == pytest.approx(3e21, rel=1e-9)
    assert allocate(law, tokens=a.n_tokens).flops == pytest.approx(3e21, rel=1e-9)
    assert 6 * a.n_params * a.n_tokens == pytest.approx(3e21)


def test_besiroglu_scales_n_and_d_about_equally():
    # a = 0.3658 / (0.3478 + 0.3658) = 0.5126 (their Table 1 reports a = 0.5126)
    assert BESIROGLU.a == pytest.approx(0.5126, abs=1e-4)
    assert 15 < BESIROGLU.tokens_per_parameter(1e22) < 30


def test_allocation_rejects_bad_input():
    with pytest.raises(InputError, match="exactly one"):
        allocate(HOFFMANN, flops=1e20, params=1e9)
    with pytest.raises(InputError, match="positive"):
        allocate(HOFFMANN, flops=-1.0)


def test_config_near_gpt2_small_is_gpt2_small():
    c = config_near(124.4e6, "gpt2-124m")
    assert (c.n_layers, c.d_model, c.n_heads) == (12, 768, 12)


def test_config_near_a_count_builds_a_model_of_about_that_size(one_thread):
    c = config_near(1e6, "tiny")
    built = sum(p.numel() for p in DecoderLM(c).parameters())       # independent of the accounting
    assert abs(built / 1e6 - 1) < 0.1
    assert 32 <= c.d_model / c.n_layers <= 128
    big = config_near(7e10, "llama-style")                           # too big to build: the count only
    assert big.n_heads // big.n_kv_heads == 4 and big.d_model % 64 == 0
    assert 32 <= big.d_model / big.n_layers <= 128


def test_memory_matches_adamw_state_and_kv_cache_by_hand(one_thread):
    c = TransformerConfig.from_name("tiny")
    model = DecoderLM(c)
    n = sum(p.numel() for p in model.parameters())
    opt = make_optimizer(model, 1e-3, (0.9, 0.99), 0.1, "cpu")
    ids = torch.randint(0, c.vocab_size, (2, 17))
    model(ids[:, :-1], targets=ids[:, 1:])[1].backward()
    opt.step()
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for k, t in s.items() if k != "step")
    mem = training_memory(c, batch_size=2, seq_len=64)
    assert mem.parameters == 4 * n and mem.gradients == 4 * n
    assert mem.optimizer == state                                    # exp_avg + exp_avg_sq, fp32
    assert mem.kv_cache == 2 * 4 * 64 * 4 * 32 * 2                   # 2 (K,V) · L · T · h_kv · d_head · bf16
    assert mem.kv_cache == model.new_state(1, 64, torch.bfloat16).nbytes   # what inference allocates


def _saved_bytes(config, batch, seq):
    """Bytes of the tensors autograd saves for backward (distinct storages, parameters excluded)."""
    model = DecoderLM(config)
    params = {p.data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        if t.data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    ids = torch.randint(0, config.vocab_size, (batch, seq + 1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids[:, :-1], targets=ids[:, 1:])
    return sum(seen.values())


@pytest.mark.parametrize("name, kw", [
    ("tiny", {}),
    ("tiny", dict(attention_backend="math")),
    ("llama-style", dict(n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, context_length=128, vocab_size=1000)),
    ("gpt2-124m", dict(n_layers=2, d_model=192, n_heads=3, context_length=128, vocab_size=2000)),
])
def test_activation_estimate_within_a_quarter_of_what_autograd_saves(one_thread, name, kw):
    c = TransformerConfig.from_name(name, **kw)
    measured = _saved_bytes(c, 2, c.context_length)
    estimate = activation_bytes(c, 2, c.context_length, attention_matrix=c.attention_backend == "math")
    assert 0.75 < estimate / measured < 1.25


def test_measured_throughput_is_a_positive_rate(one_thread):
    rate = measure_flops_per_second(TransformerConfig.from_name("tiny", n_layers=1), batch_size=2, seconds=0.1)
    assert math.isfinite(rate) and rate > 1e6


def test_plan_command_prints_and_writes_json(capsys):
    assert main(["plan", "--flops", "5.76e23", "--flops-per-second", "1e11"]) == 0
    out = capsys.readouterr().out
    for word in ("Hoffmann 2022", "Besiroglu 2024", "Kaplan 2020", "config near N", "AdamW state", "KV cache"):
        assert word in out
    assert main(["plan", "--params", "1e6", "--preset", "tiny", "--flops-per-second", "1e10", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert [a["law"] for a in plan["allocations"]] == ["Hoffmann 2022", "Besiroglu 2024", "Kaplan 2020"]
    assert plan["allocations"][1]["n_params"] == pytest.approx(1e6)
    assert plan["seconds"] == pytest.approx(plan["train_flops"] / 1e10)
    assert plan["steps"] == math.ceil(plan["allocations"][1]["n_tokens"] / (8 * 64))


@pytest.mark.parametrize("args, words", [
    (["--flops", "-5", "--flops-per-second", "1e9"], "positive"),
    (["--flops", "1e20", "--flops-per-second", "0"], "--flops-per-second"),
    (["--flops", "1e20", "--flops-per-second", "1e9", "--batch-size", "0"], "--batch-size"),
])
def test_plan_bad_input_is_one_line(capsys, args, words):
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err and "Traceback" not in err


def test_plan_works_without_scipy_and_the_fit_says_how_to_get_it():
    code = ("import sys; sys.modules['scipy'] = None\n"
            "from tformer.cli import main\n"
            "assert main(['plan', '--flops', '1e20', '--flops-per-second', '1e10']) == 0\n"
            "from tformer.errors import ConfigError\n"
            "from tformer.scaling.fit import fit_parametric\n"
            "try:\n    fit_parametric([1e6] * 5, [1e8] * 5, [3.0] * 5)\n"
            "except ConfigError as e:\n    assert 'tformer[scaling]' in str(e)\n"
            "else:\n    raise SystemExit('no error')\n")
    env = {**os.environ, "PYTHONPATH": SRC}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
