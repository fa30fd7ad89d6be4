"""Training recipes: Muon's parameter split and one step against a float64 Newton–Schulz reference,
the WSD schedule's closed form, the recipe defaults, target_loss, and an exact resume under Muon."""

import math

import numpy as np
import pytest
import torch

from tformer import DecoderLM, TransformerConfig
from tformer.errors import ConfigError
from tformer.training.config import TrainConfig
from tformer.training.optim import MuonAdamW, build_optimizer, muon_split
from tformer.training.recipes import apply_recipe, resolve_recipe
from tformer.training.schedule import schedule_at, wsd_at

from tests.training.test_training import TINY, _trainer


def _model(**kw):
    torch.manual_seed(0)
    return DecoderLM(TransformerConfig(vocab_size=23, context_length=8, n_layers=2, d_model=16, n_heads=2, **kw))


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    model = _model(bias=True)
    matrices, rest = muon_split(model)
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[id(p)].split(".", 2)[2] for p in matrices) == sorted(
        ["attn.qkv_proj.weight", "attn.out_proj.weight", "ffn.up.weight", "ffn.down.weight"] * 2)
    rest_names = {n for n, _ in rest}
    assert "tok_emb.weight" in rest_names and "pos_emb.weight" in rest_names   # embeddings, the tied head
    assert all(p.dim() == 2 for p in matrices)
    assert len(matrices) + len(rest) == len(list(model.parameters()))
    assert sum(p.numel() for p in matrices) + sum(p.numel() for _, p in rest) == model.num_parameters()
    untied = _model(tie_embeddings=False)
    assert "lm_head.weight" in {n for n, _ in muon_split(untied)[1]}


def _newton_schulz64(g: np.ndarray, steps: int = 5) -> np.ndarray:
    """The quintic Newton–Schulz iteration (Jordan et al.'s coefficients) in float64:
    X ← aX + (bA + cA²)X with A = XXᵀ, from X = G / ||G||_F, on the wide orientation."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.T if g.shape[0] > g.shape[1] else g
    x = x / np.linalg.norm(x)
    for _ in range(steps):
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    return x.T if g.shape[0] > g.shape[1] else x


def test_one_muon_step_matches_float64_newton_schulz():
    """First step from zero momentum: the Nesterov update is (1 - μ²)·g, whose orthogonalisation
    (scale-free) is NS(g); W ← W·(1 - lr·wd) - lr·sqrt(max(1, rows/cols))·NS(g). torch runs NS in
    bf16 (8-bit mantissa, five iterations): on random matrices its result is 1.4-1.9% of its norm
    from float64's, so the update must agree to 4% (Frobenius); a wrong lr scale, decay, momentum
    form or orientation is off by far more. AdamW's parameters match a plain AdamW step to 1e-7."""
    model = _model()
    cfg = TrainConfig(optimizer="muon", muon_lr=0.05, lr=1e-3, weight_decay=0.1)
    opt = build_optimizer(model, cfg)
    assert isinstance(opt, MuonAdamW)
    for group in opt.param_groups:
        group["lr"] = cfg.lr * group["lr_scale"]
    matrices, rest = muon_split(model)
    ref_model = _model()
    ref_adamw = torch.optim.AdamW([p for n, p in ref_model.named_parameters() if n in dict(rest)], lr=1e-3,
                                  betas=(0.9, 0.99), weight_decay=0.0)
    before = [p.detach().double().clone() for p in matrices]
    gen = torch.Generator().manual_seed(1)   # random gradients: well-conditioned, unlike a tiny batch's
    for (_, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        p.grad = torch.randn(p.shape, generator=gen)
        q.grad = p.grad.clone()
    grads = [p.grad.double().numpy() for p in matrices]
    opt.step()
    # the reference: AdamW for the rest, with the decay only on matrices (embeddings decay in tformer)
    wd_rest = {n for n, p in rest if p.dim() >= 2}
    for n, p in ref_model.named_parameters():
        if n in wd_rest:
            p.data.mul_(1 - 1e-3 * 0.1)
    ref_adamw.step()
    ref = dict(ref_model.named_parameters())
    for n, p in rest:
        assert torch.allclose(p, ref[n], atol=1e-7, rtol=0), n
    wd = 0.1 * cfg.lr / cfg.muon_lr               # Muon's decay per step matches AdamW's lr·wd
    for p, w0, g in zip(matrices, before, grads):
        scale = 0.05 * math.sqrt(max(1.0, p.shape[0] / p.shape[1]))
        want = w0.numpy() * (1 - 0.05 * wd) - scale * _newton_schulz64(g)
        step = w0.numpy() - want
        err = np.linalg.norm(p.detach().double().numpy() - want) / np.linalg.norm(step)
        assert err < 0.04, err


def test_newton_schulz_reference_is_near_orthogonal():
    """The reference itself: NS(G)'s singular values lie in (0.6, 1.3) (the quintic's band), not G's spread."""
    g = np.random.default_rng(0).normal(size=(16, 48)) * np.linspace(0.01, 3, 48)
    s = np.linalg.svd(_newton_schulz64(g), compute_uv=False)
    assert s.min() > 0.6 and s.max() < 1.3, s


def test_wsd_closed_form():
    kw = dict(lr=1e-3, min_lr=0.0, warmup_steps=100, decay_steps=2100, cooldown_fraction=0.5)
    assert wsd_at(0, **kw) == pytest.approx(1e-3 / 101)
    assert wsd_at(100, **kw) == wsd_at(1099, **kw) == 1e-3                 # stable until 2100 - 1000
    assert wsd_at(1100, **kw) == pytest.approx(1e-3)
    assert wsd_at(1600, **kw) == pytest.approx(5e-4)                        # half-way down the cool-down
    assert wsd_at(2100, **kw) == wsd_at(9000, **kw) == 0.0
    lrs = [wsd_at(s, **kw) for s in range(100, 2101)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    cfg = TrainConfig(schedule="wsd", lr=1e-3, min_lr=0.0, warmup_steps=100, max_steps=2100, cooldown_fraction=0.5)
    assert schedule_at(cfg, 1600) == pytest.approx(5e-4)
    assert schedule_at(TrainConfig(), 0) == pytest.approx(1e-3 / 101)      # cosine stays the default schedule


def test_recipes_fill_only_what_is_unset():
    assert resolve_recipe("auto", "tiny") == "fast" and resolve_recipe("auto", "gpt2-124m") == "classic"
    assert resolve_recipe("auto", "tiny", "mamba") == "classic"
    model, train = apply_recipe("auto", "tiny", {"activation": "gelu"}, {"optimizer": "muon"})
    assert model["activation"] == "gelu" and model["zero_init_residual"] is True and train["optimizer"] == "muon"
    assert train["schedule"] == "wsd" and train["recipe"] == "fast" and train["lr"] == pytest.approx(3e-3)
    assert model["positions"] == "rope" and train["beta2"] == 0.95
    assert apply_recipe("auto", "shakespeare-char", {}, {})[1]["lr"] == pytest.approx(3e-3 / 3)   # d = 384
    assert apply_recipe("auto", "tiny", {"d_model": 256}, {"lr": 1e-3})[1]["lr"] == 1e-3
    assert apply_recipe("auto", "tiny", {"d_model": 32}, {})[1]["lr"] == pytest.approx(3e-3)   # never above
    model, train = apply_recipe("classic", "tiny", {}, {})
    assert model == {} and train == {"recipe": "classic"}
    assert apply_recipe("auto", "tiny", {"positions": "learned"}, {})[0]["positions"] == "learned"
    model, _ = apply_recipe("fast", "gpt2-124m", {}, {})
    assert "activation" not in model and "positions" not in model          # the preset fixes gelu_tanh, learned
    with pytest.raises(ConfigError):
        resolve_recipe("speedrun", "tiny")


@pytest.mark.parametrize("bad", [dict(optimizer="sgd"), dict(schedule="linear"), dict(muon_lr=0.0),
                                 dict(cooldown_fraction=1.5), dict(target_loss=-1.0), dict(recipe="x"),
                                 dict(optimizer="muon", strategy="fsdp")])
def test_recipe_settings_are_validated(bad):
    with pytest.raises(ConfigError):
        TrainConfig(**bad)


def test_default_run_uses_the_fast_recipe_and_stops_at_the_target(tmp_path):
    tr = _trainer(tmp_path, max_steps=40, eval_interval=10, target_loss=50.0)
    assert tr.cfg.recipe == "fast" and tr.cfg.schedule == "wsd" and tr.model.config.activation == "relu2"
    result = tr.fit()
    assert result["stopped"] == "done" and result["step"] == 10       # the first evaluation after step 0


def test_resume_is_exact_under_muon(tmp_path):
    """20 steps straight == 10 + resume + 10 with Muon's momentum saved and restored (fp32)."""
    kw = dict(decay_steps=20, warmup_steps=3, optimizer="muon", schedule="wsd")
    straight = _trainer(tmp_path, "a", max_steps=20, **kw).fit()
    _trainer(tmp_path, "b", max_steps=10, **kw).fit()
    resumed = _trainer(tmp_path, "b", resume=True, max_steps=20).fit()
    a = [r["loss"] for r in straight["history"] if "loss" in r]
    b = [r["loss"] for r in resumed["history"] if "loss" in r]
    assert len(b) == 10 and np.allclose(a[10:], b, rtol=0, atol=1e-6), (a[10:], b)
    assert TINY["precision"] == "fp32"


def test_float32_muon_matches_float64_over_steps_and_torchs_muon():
    """Three steps with momentum, from random gradients: Float32Muon equals the float64 formulas
    (B ← μB + (1-μ)g, u = (1-μ)g + μB, W ← W(1 - lr·wd) - lr·sqrt(max(1, r/c))·NS(u)) to 1e-4 of the
    weights' change, and torch's bf16 Muon to its rounding (4%, as above)."""
    from tformer.training.optim import Float32Muon
    gen = torch.Generator().manual_seed(3)
    w0 = torch.randn(48, 16, generator=gen)
    grads = [torch.randn(48, 16, generator=gen) for _ in range(3)]
    lr, wd, mu = 0.05, 0.01, 0.95
    results = {}
    for kind in (Float32Muon, torch.optim.Muon):
        w = torch.nn.Parameter(w0.clone())
        opt = kind([w], lr=lr, weight_decay=wd, momentum=mu, nesterov=True)
        for g in grads:
            w.grad = g.clone()
            opt.step()
        results[kind] = w.detach().double()
    ref, buf = w0.double().numpy(), np.zeros((48, 16))
    for g in grads:
        g = g.double().numpy()
        buf = mu * buf + (1 - mu) * g
        u = (1 - mu) * g + mu * buf
        ref = ref * (1 - lr * wd) - lr * math.sqrt(3.0) * _newton_schulz64(u)
    change = np.linalg.norm(ref - w0.double().numpy())
    assert np.linalg.norm(results[Float32Muon].numpy() - ref) / change < 1e-4
    assert np.linalg.norm(results[torch.optim.Muon].numpy() - ref) / change < 0.04
    # the same state layout: torch's Muon state loads into Float32Muon
    w = torch.nn.Parameter(w0.clone())
    theirs = torch.optim.Muon([w], lr=lr)
    w.grad = grads[0].clone()
    theirs.step()
    ours = Float32Muon([w], lr=lr)
    ours.load_state_dict(theirs.state_dict())
    assert torch.equal(ours.state[w]["momentum_buffer"], theirs.state[w]["momentum_buffer"])


def test_muon_runs_newton_schulz_in_float32_without_native_bf16(monkeypatch):
    from tformer.training import optim
    from tformer.training.optim import Float32Muon
    cfg = TrainConfig(optimizer="muon")
    assert type(build_optimizer(_model(), cfg).muon) is (Float32Muon if not optim.bf16_supported() else torch.optim.Muon)
    monkeypatch.setattr(optim, "bf16_supported", lambda device="cpu": False)
    assert type(build_optimizer(_model(), cfg).muon) is Float32Muon
    monkeypatch.setattr(optim, "bf16_supported", lambda device="cpu": True)
    assert type(build_optimizer(_model(), cfg).muon) is torch.optim.Muon
