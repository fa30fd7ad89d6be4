"""Training: schedule, optimizer groups, data, overfitting, exact resume, atomic checkpoints, NaN stop."""

import math
import os
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tformer import checkpoint
from tformer.checkpoint import load_model, resolve_checkpoint
from tformer.training import data as data_mod
from tformer.training.data import get_batch, load_corpus
from tformer.training.optim import lr_at, make_optimizer
from tformer.training.trainer import Trainer

TINY = dict(n_layers=1, d_model=32, n_heads=2, context_length=16, batch_size=4, eval_batches=2,
            eval_interval=5, log_interval=1, sample_tokens=0, progress=False, threads=1, precision="fp32")


def _corpus(tmp_path, text=None):
    path = tmp_path / "corpus.txt"
    text = text or "".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(80))
    if not path.is_file() or path.read_text() != text:      # keep the mtime: the cache key includes it
        path.write_text(text)
    return str(path)


def _trainer(tmp_path, out="run", resume=False, **kw):
    settings = {**TINY, "data": _corpus(tmp_path), "out_dir": str(tmp_path / out),
                "cache_dir": str(tmp_path / "cache"), **kw}
    return Trainer.create(settings, resume=resume, log=lambda m: None)


def test_lr_schedule_closed_form():
    kw = dict(lr=1e-3, min_lr=1e-4, warmup_steps=100, decay_steps=2000)
    assert lr_at(0, **kw) == pytest.approx(1e-3 / 101)
    assert lr_at(99, **kw) == pytest.approx(1e-3 * 100 / 101)
    assert lr_at(100, **kw) == pytest.approx(1e-3)                     # peak after warmup
    assert lr_at(1050, **kw) == pytest.approx(5.5e-4)                  # cosine midpoint: (lr + min_lr) / 2
    assert lr_at(2000, **kw) == lr_at(5000, **kw) == pytest.approx(1e-4)
    steps = [lr_at(s, **kw) for s in range(100, 2001)]
    assert all(a >= b for a, b in zip(steps, steps[1:]))               # monotone decay


def test_weight_decay_on_matrices_only():
    from tformer import DecoderLM, TransformerConfig
    model = DecoderLM(TransformerConfig(vocab_size=11, context_length=8, n_layers=1, d_model=16, n_heads=2))
    opt = make_optimizer(model, 1e-3, (0.9, 0.99), 0.1)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == model.num_parameters()


def test_batches_are_shifted_windows_and_reproducible():
    data = np.arange(1000, dtype=np.uint16)
    x, y = get_batch(data, 8, 16, (1, 0, 5, 0))
    assert x.shape == y.shape == (8, 16) and x.dtype == torch.int64
    assert torch.equal(y, x + 1)                                        # next token of a window of arange
    assert torch.equal(get_batch(data, 8, 16, (1, 0, 5, 0))[0], x)
    assert not torch.equal(get_batch(data, 8, 16, (1, 0, 6, 0))[0], x)
    assert int(x.max()) + 1 <= 999


def test_cache_is_reused_and_memory_mapped(tmp_path, monkeypatch):
    path = _corpus(tmp_path)
    first = load_corpus(path, cache_dir=tmp_path / "c", log=lambda m: None)
    monkeypatch.setattr(data_mod, "train_tokenizer", lambda *a, **k: pytest.fail("re-tokenised a cached corpus"))
    second = load_corpus(path, cache_dir=tmp_path / "c", log=lambda m: None)
    assert isinstance(second.train, np.memmap) and second.train.dtype == np.uint16
    assert np.array_equal(first.val, second.val) and first.fingerprint == second.fingerprint
    n = first.n_tokens
    assert len(first.val) == round(0.1 * n)                             # contiguous 10% tail
    text = open(path).read()
    assert first.tokenizer.decode(first.val) == text[n - len(first.val):]


def test_default_corpus_is_stdlib_source_capped():
    import sysconfig
    files = data_mod.default_corpus_files()
    assert len(files) > 10 and files == data_mod.default_corpus_files()          # deterministic
    root = sysconfig.get_paths()["stdlib"]
    assert all(f.suffix == ".py" and str(f).startswith(root) for f in files)
    assert not any(part in ("site-packages", "test") for f in files for part in f.parts)
    assert sum(f.stat().st_size for f in files) <= data_mod.DEFAULT_CORPUS_BYTES


def test_overfits_a_short_repeated_text(tmp_path):
    """A 1-layer model memorises a 26-character cycle: loss < 0.1 nats within 150 steps (from ln 27 ≈ 3.3)."""
    text = "abcdefghijklmnopqrstuvwxyz " * 200
    settings = {**TINY, "data": _corpus(tmp_path, text), "out_dir": str(tmp_path / "o"),
                "cache_dir": str(tmp_path / "cache"), "max_steps": 150, "lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 10,
                "eval_interval": 150}
    result = Trainer.create(settings, log=lambda m: None).fit()
    losses = [r["loss"] for r in result["history"] if "loss" in r]
    assert losses[0] > 2.5 and losses[-1] < 0.1
    assert result["best_val_loss"] < 0.1


def test_eval_loss_equals_cross_entropy_by_hand(tmp_path):
    tr = _trainer(tmp_path)
    got = tr.evaluate()["val_loss"]
    ref = []
    with torch.no_grad():
        for k in range(tr.cfg.eval_batches):
            x, y = get_batch(tr.corpus.val, tr.cfg.batch_size, 16, (tr.cfg.seed, 2, k))
            logits, _ = tr.model(x)
            ref.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item())
    assert got == pytest.approx(sum(ref) / len(ref), abs=1e-6)


def test_resume_is_exact_in_fp32(tmp_path):
    """20 steps straight == 10 steps + resume + 10 steps, loss by loss, to 1e-6 (same data, same RNG)."""
    straight = _trainer(tmp_path, "a", max_steps=20, decay_steps=20, warmup_steps=3, dropout=0.1).fit()
    _trainer(tmp_path, "b", max_steps=10, decay_steps=20, warmup_steps=3, dropout=0.1).fit()
    resumed = _trainer(tmp_path, "b", resume=True, max_steps=20).fit()
    a = [r["loss"] for r in straight["history"] if "loss" in r]
    b = [r["loss"] for r in resumed["history"] if "loss" in r]
    assert len(a) == 20 and len(b) == 10
    assert np.allclose(a[10:], b, rtol=0, atol=1e-6), (a[10:], b)
    wa = load_model(resolve_checkpoint(tmp_path / "a")).state_dict()
    wb = load_model(resolve_checkpoint(tmp_path / "b")).state_dict()
    assert all(torch.allclose(wa[k], wb[k], atol=1e-6, rtol=0) for k in wa)


def test_checkpoint_survives_a_crash_at_every_rename(tmp_path, monkeypatch):
    """Kill the second save at each temp-file -> rename point: the first checkpoint still loads intact."""
    tr = _trainer(tmp_path, max_steps=2)
    tr.save()
    before = {k: v.clone() for k, v in tr.model.state_dict().items()}
    tr.step = 1
    with torch.no_grad():
        for p in tr.model.parameters():
            p.add_(1.0)
    real_replace, calls = os.replace, {"n": 0}

    def count(*a):
        calls["n"] += 1
        return real_replace(*a)
    monkeypatch.setattr(checkpoint.os, "replace", count)
    import shutil
    shutil.copytree(tmp_path / "run", tmp_path / "pristine")
    tr.save()
    total = calls["n"]
    assert total >= 6                                                   # 5 files + the pointer
    for crash_at in range(1, total + 1):
        shutil.rmtree(tmp_path / "run")
        shutil.copytree(tmp_path / "pristine", tmp_path / "run")
        calls["n"] = 0

        def crash(*a, _at=crash_at):
            calls["n"] += 1
            if calls["n"] == _at:
                raise KeyboardInterrupt("killed between temp write and rename")
            return real_replace(*a)
        monkeypatch.setattr(checkpoint.os, "replace", crash)
        tr.saved_step = None
        with pytest.raises(KeyboardInterrupt):
            tr.save()
        folder = resolve_checkpoint(tmp_path / "run")
        assert folder.name == "step-0000000"
        state = load_model(folder).state_dict()
        assert all(torch.equal(state[k], before[k]) for k in before)
        assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]
    monkeypatch.setattr(checkpoint.os, "replace", real_replace)
    tr.save()                                                           # and a later save still works
    assert resolve_checkpoint(tmp_path / "run").name == "step-0000001"


def test_nan_loss_stops_with_the_step_and_keeps_the_checkpoint(tmp_path, monkeypatch):
    tr = _trainer(tmp_path, max_steps=20)
    real = Trainer._train_step
    monkeypatch.setattr(Trainer, "_train_step",
                        lambda self, lr: float("nan") if self.step == 7 else real(self, lr))
    with pytest.raises(ValueError, match=r"loss became nan at step 8.*checkpoint \(step 5\)"):
        tr.fit()
    assert resolve_checkpoint(tmp_path / "run").name == "step-0000005"


def test_bf16_autocast_trains_close_to_fp32(tmp_path):
    """Same 5 steps in bf16 and fp32: losses agree to 0.05 nats (bf16 has ~3 significant digits)."""
    a = _trainer(tmp_path, "a", max_steps=5, precision="fp32").fit()
    b = _trainer(tmp_path, "b", max_steps=5, precision="bf16").fit()
    la = [r["loss"] for r in a["history"] if "loss" in r]
    lb = [r["loss"] for r in b["history"] if "loss" in r]
    assert math.isclose(la[0], lb[0], abs_tol=0.05) and math.isclose(la[-1], lb[-1], abs_tol=0.05)


def test_resume_reuses_the_tokenised_cache(tmp_path, monkeypatch):
    _trainer(tmp_path, max_steps=2).fit()
    monkeypatch.setattr(data_mod, "_build_cache", lambda *a: pytest.fail("re-tokenised the corpus on resume"))
    assert _trainer(tmp_path, resume=True, max_steps=3).fit()["step"] == 3


def test_busy_cores_sees_another_process_spinning():
    """The thread choice and the benchmarks' load check read current CPU use, not the lagging load average."""
    import subprocess
    import sys

    from tformer.machine import busy_cores

    spinner = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 3: pass"])
    try:
        time.sleep(0.3)
        busy = busy_cores(0.5)
    finally:
        spinner.wait()
    assert 0.5 <= busy <= (os.cpu_count() or 1) + 0.01


@pytest.mark.parametrize("mixer,extra", [
    ("attention", {}), ("mamba", {"ffn": "none", "positions": "none"}), ("longformer", {}), ("performer", {}),
    ("bigbird", {"causal": False}), ("linformer", {"causal": False}),
])
def test_weight_decay_groups_for_every_mixer(tmp_path, mixer, extra):
    """What `tformer train --set mixer=M` decays: every matrix, except what is marked no_weight_decay
    (Mamba's A_log, 2-D, its dynamics); never a vector (biases, norm gains, Mamba's D and Δ bias).
    BigBird and Linformer are bidirectional, which `tformer train` refuses: their encoders go through
    the same make_optimizer."""
    options = {"bigbird": {"block_size": 8}, "longformer": {"window": 8}, "linformer": {"k": 8}}.get(mixer)
    kw = {"mixer": mixer, **extra, **({"mixer_options": {mixer: options}} if options else {})}
    if extra.get("causal") is False:
        from tformer.config import TransformerConfig
        from tformer.models import build_model
        model = build_model(TransformerConfig(vocab_size=64, **{k: v for k, v in TINY.items() if k in
                                                                 ("n_layers", "d_model", "n_heads", "context_length")}, **kw))
        optimizer = make_optimizer(model, 1e-3, (0.9, 0.95), 0.1)
    else:
        trainer = _trainer(tmp_path, **kw)
        model, optimizer = trainer.model, trainer.optimizer
    decayed = {id(p) for g in optimizer.param_groups if g["weight_decay"] > 0 for p in g["params"]}   # Muon's group
    spared = {id(p) for g in optimizer.param_groups if g["weight_decay"] == 0 for p in g["params"]}  # decays too
    names = dict((id(p), n) for n, p in model.named_parameters())
    for n, p in model.named_parameters():
        marked = n.endswith(("A_log", ".D", "dt_bias"))
        assert (id(p) in spared) == (p.dim() < 2 or marked), n
        assert (id(p) in decayed) == (p.dim() >= 2 and not marked), n
    if mixer == "mamba":
        assert {names[i].rsplit(".", 1)[-1] for i in spared} >= {"A_log", "D", "dt_bias", "weight"}
