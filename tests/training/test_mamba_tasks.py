"""The synthetic tasks of benchmarks/mamba_tasks.py hold what their docstrings say, checked against a
plain per-sequence reading of each sequence (inputs, targets and the loss mask aligned: the model's
loss does not shift targets, so the target at position t is the token to output after reading t)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from mamba_tasks import induction_heads, param_groups, selective_copying  # noqa: E402

from tformer.models import build_model  # noqa: E402


def test_selective_copying_targets_are_the_data_tokens_in_order():
    L, K, n_data = 20, 5, 8
    ids, targets = selective_copying(64, L=L, K=K, n_data=n_data, g=torch.Generator().manual_seed(0))
    assert ids.shape == targets.shape == (64, L + K)
    for row, tgt in zip(ids.tolist(), targets.tolist()):
        data = [t for t in row[:L] if t != 0]                        # the K data tokens among the noise (0)
        assert len(data) == K and all(1 <= t <= n_data for t in data)
        assert row[L] == n_data + 1                                  # the go token
        assert tgt[:L] == [-100] * L and tgt[L:] == data             # loss only on the K outputs, in order
        assert row[L + 1:] == data[:-1]                              # teacher forcing: the previous output


def test_induction_heads_target_is_the_token_after_the_first_special_token():
    T = 40
    ids, targets = induction_heads(64, T, n_tokens=16, g=torch.Generator().manual_seed(0))
    for row, tgt in zip(ids.tolist(), targets.tolist()):
        first = row.index(0)
        assert row.count(0) == 2 and row[-1] == 0 and first < T - 2  # the special token: once inside, once last
        assert tgt[:-1] == [-100] * (T - 1) and tgt[-1] == row[first + 1]


def test_no_weight_decay_on_A_log_norms_or_vectors():
    from mamba_tasks import mamba_config
    model = build_model(mamba_config(10, d=16, n_layers=1))
    decay, plain = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert {names[id(p)].split(".")[-1] for p in plain["params"]} >= {"A_log", "D", "dt_bias", "weight"}
    assert all(p.dim() >= 2 and not names[id(p)].endswith("A_log") for p in decay["params"])
    assert len(decay["params"]) + len(plain["params"]) == len(list(model.parameters()))
