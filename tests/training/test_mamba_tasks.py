"""The synthetic tasks of tformer.training.tasks.mamba hold what their docstrings say, checked against a
plain per-sequence reading of each sequence (inputs, targets and the loss mask aligned: the model's
loss does not shift targets, so the target at position t is the token to output after reading t)."""

from __future__ import annotations

import torch

from tformer.models import build_model
from tformer.training.optim import param_groups
from tformer.training.tasks.base import step_generator
from tformer.training.tasks.mamba import Synthetic, accuracy, induction_heads, mamba_config, selective_copying, train


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
    model = build_model(mamba_config(10, d=16, n_layers=1))
    decay, plain = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert {names[id(p)].split(".")[-1] for p in plain["params"]} >= {"A_log", "D", "dt_bias", "weight"}
    assert all(p.dim() >= 2 and not names[id(p)].endswith("A_log") for p in decay["params"])
    assert len(decay["params"]) + len(plain["params"]) == len(list(model.parameters()))


def test_a_step_batch_depends_on_the_seed_and_step_alone():
    """The batch of step s is the same however the run got there (what exact resume needs)."""
    task = Synthetic(lambda b, g: induction_heads(b, 12, g=g), 4, seed=3)
    first = task.batch(5)
    for _ in range(3):
        task.batch(2)
    assert all(torch.equal(a, b) for a, b in zip(task.batch(5), first))
    assert not torch.equal(task.batch(6)[0], first[0])
    assert step_generator(4, 5).initial_seed() != step_generator(3, 5).initial_seed()


def test_training_run_learns_and_stops_at_the_target_accuracy(one_thread):
    """The loop on fresh batches learns a 4-token copy; with a held-out target it stops early."""
    make = lambda b, g: selective_copying(b, L=8, K=2, n_data=4, g=g)          # noqa: E731
    held = make(64, torch.Generator().manual_seed(99))
    config = mamba_config(6, d=16, n_layers=1, context=16)
    before = accuracy(build_model(config).eval(), *held)
    model, losses, seconds, steps = train(config, make, 400, 32, lr=1e-2, stop=(*held, 25, 0.9))
    assert accuracy(model, *held) >= 0.9 > before and steps < 400 and steps % 25 == 0
    assert len(losses) == steps and losses[-1] < losses[0] and seconds > 0
