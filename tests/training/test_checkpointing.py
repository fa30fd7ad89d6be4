"""Activation checkpointing (:mod:`tformer.training.checkpointing`): the gradients equal the plain
step's within 1e-6 of each gradient's largest entry (fp32; measured: bit-identical), with dropout
(the recomputation replays the forward's random draws), LoRA + the shared prefix, bf16 autocast and
an encoder-decoder; the blocks really run twice and the autograd graph holds far fewer activation bytes.
The reference is the same model's plain forward and backward (torch's own autograd); DDP and FSDP with
checkpointing against one plain process are in ``test_distributed.py``."""

from __future__ import annotations

import pytest
import torch

from finetune_fixtures import with_active_lora
from test_shared_prefix import chat_batch, tiny
from tformer.config import TransformerConfig
from tformer.errors import ConfigError
from tformer.models import build_model
from tformer.models.block import Block
from tformer.training import shared_prefix
from tformer.training.checkpointing import enable_checkpointing

TOL = 1e-6


def grads(model, loss_fn, seed: int = 0):
    torch.manual_seed(seed)                      # the same dropout draws for both runs
    loss = loss_fn()
    loss.backward()
    g = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), g


def assert_same(plain, ckpt):
    (l0, g0), (l1, g1) = plain, ckpt
    assert l1 == pytest.approx(l0, rel=TOL)
    assert g0.keys() == g1.keys() and g0
    for n in g0:
        scale = float(g0[n].abs().max()) or 1.0
        assert float((g0[n] - g1[n]).abs().max()) <= TOL * scale, n


def both(model, loss_fn):
    plain = grads(model, loss_fn)
    assert enable_checkpointing(model) == len(model.blocks)
    return plain, grads(model, loss_fn)


def lm_batch(vocab=97, B=3, T=20):
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, vocab, (B, T), generator=g), torch.randint(0, vocab, (B, T), generator=g)


def test_pretraining_step_with_dropout_equals_the_plain_step():
    model = tiny(dropout=0.1, attn_dropout=0.1).train()
    ids, y = lm_batch()
    assert_same(*both(model, lambda: model(ids, y)[1]))


def test_the_blocks_run_again_in_the_backward_and_keep_fewer_activations(monkeypatch):
    model = tiny(n_layers=4, d_model=64, n_heads=4, n_kv_heads=2).train()
    ids, y = lm_batch(B=4, T=48)
    calls = []
    forward = Block.forward            # counted in the method: the recomputation does not fire module hooks
    monkeypatch.setattr(Block, "forward", lambda self, *a, **k: calls.append(1) or forward(self, *a, **k))

    def saved_bytes():
        total = [0]

        def pack(t):
            total[0] += t.numel() * t.element_size() if t.requires_grad or t.grad_fn is not None else 0
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(ids, y)[1]
        loss.backward()
        model.zero_grad(set_to_none=True)
        return total[0]

    plain = saved_bytes()
    assert len(calls) == 4
    enable_checkpointing(model)
    calls.clear()
    ckpt = saved_bytes()
    assert len(calls) == 8                                   # forward, then each block again in the backward
    assert ckpt < 0.5 * plain, (ckpt, plain)


def test_lora_with_the_shared_prefix_equals_the_plain_step(monkeypatch):
    model = with_active_lora(tiny()).train()
    ids, targets = chat_batch()
    assert shared_prefix.can_share(model)
    shared = []
    store = shared_prefix._SharedPrefix.store
    monkeypatch.setattr(shared_prefix._SharedPrefix, "store", lambda self, *a: shared.append(1) or store(self, *a))
    plain, ckpt = both(model, lambda: shared_prefix.prefix_shared_loss(model, ids, targets))
    assert shared                                            # the shared-prefix path ran, not its fallback
    assert_same(plain, ckpt)
    assert all(".lora_" in n for n in ckpt[1])               # the base stays frozen


def test_bf16_autocast_equals_the_plain_autocast_step():
    model = tiny().train()
    ids, y = lm_batch()

    def loss():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(ids, y)[1]
    assert_same(*both(model, loss))


def test_encoder_decoder_covers_both_stacks():
    c = TransformerConfig(model="encoder-decoder", vocab_size=50, context_length=16, n_layers=2, d_model=32, n_heads=4,
                          dropout=0.1)
    torch.manual_seed(0)
    model = build_model(c).train()
    src, tgt = lm_batch(50, 2, 10)
    plain = grads(model, lambda: model(src, tgt, tgt)[1])
    assert enable_checkpointing(model) == 2 * c.n_layers and model.encoder.checkpointing and model.decoder.checkpointing
    assert_same(plain, grads(model, lambda: model(src, tgt, tgt)[1]))


def test_eval_and_no_grad_do_not_checkpoint(monkeypatch):
    import tformer.models.stack as stack
    used = []
    monkeypatch.setattr(stack, "checkpoint", lambda *a, **k: used.append(1) or torch.utils.checkpoint.checkpoint(*a, **k))
    model = tiny()
    enable_checkpointing(model)
    ids, _ = lm_batch()
    with torch.no_grad():
        model.train()(ids)
    model.eval()(ids)
    assert not used
    model.train()(ids)
    assert len(used) == len(model.blocks)


def test_a_model_without_transformer_blocks_is_refused():
    c = TransformerConfig(model="bahdanau", vocab_size=30, context_length=16, n_layers=1, d_model=16, n_heads=1)
    with pytest.raises(ConfigError, match="checkpointing=true needs a model made of transformer blocks"):
        enable_checkpointing(build_model(c))


def test_the_loop_turns_it_on_from_the_setting(tmp_path):
    from tformer.training.trainer import Trainer
    corpus = tmp_path / "c.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog.\n" * 40)
    common = dict(data=str(corpus), cache_dir=str(tmp_path / "cache"), n_layers=2, d_model=32, n_heads=2,
                  context_length=16, batch_size=4, max_steps=3, eval_interval=3, eval_batches=1, sample_tokens=0,
                  progress=False, threads=1, precision="fp32", recipe="classic", log_interval=1)
    runs = {}
    for on in (False, True):
        t = Trainer.create({**common, "checkpointing": on, "out_dir": str(tmp_path / f"run-{on}")}, log=lambda m: None)
        assert t.model.checkpointing is on
        runs[on] = [r["loss"] for r in t.fit()["history"] if "loss" in r]
    assert len(runs[True]) == 3 and runs[True] == pytest.approx(runs[False], rel=TOL)


def test_finetune_with_checkpointing_takes_the_plain_steps(tmp_path):
    """``tformer finetune --set checkpointing=true`` (LoRA, the shared prefix): the same losses as without."""
    import json
    from finetune_fixtures import tiny_llama
    from tformer.cli import main
    base = tiny_llama(tmp_path / "base")
    quick = ["--set", "n_train=40", "--set", "n_test=4", "--set", "eval_exact=0", "--set", "progress=false",
             "--set", "threads=1", "--set", "batch_size=4", "--set", "max_length=48", "--set", "max_steps=4",
             "--set", "log_interval=1", "--set", "precision=fp32", "--set", "lr=1e-2", "--set", "eval_interval=4"]
    losses = {}
    for on in ("false", "true"):
        run = tmp_path / on
        assert main(["finetune", "--model", str(base), "--out", str(run), *quick, "--set", f"checkpointing={on}"]) == 0
        losses[on] = [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert len(losses["true"]) == 4 and losses["true"] == pytest.approx(losses["false"], rel=TOL)


def test_trim_heap_releases_before_each_block_and_changes_no_number(monkeypatch):
    """``trim_heap``: the heap's free pages handed back before each checkpointed block runs (its forward and
    its recomputation), the gradients bit-identical to the plain step's."""
    import tformer.models.stack as stack
    calls = []
    monkeypatch.setattr(stack, "release_free_heap", lambda: calls.append(1))
    model = tiny(dropout=0.1).train()
    ids, y = lm_batch()
    plain = grads(model, lambda: model(ids, y)[1])
    enable_checkpointing(model, trim_heap=True)
    trimmed = grads(model, lambda: model(ids, y)[1])
    assert len(calls) == 2 * len(model.blocks)               # the forward's runs and the backward's
    assert plain[0] == trimmed[0] and all(torch.equal(plain[1][n], trimmed[1][n]) for n in plain[1])


def test_release_free_heap_hands_pages_back():
    """On glibc, freed small allocations stay resident until ``malloc_trim``; after it the resident set falls."""
    import ctypes
    from tformer.machine import _malloc_trim, release_free_heap
    if _malloc_trim() is None:
        pytest.skip("not glibc: nothing to hand back")
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]

    def rss_mb():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20
    blocks = [libc.malloc(64 * 1024) for _ in range(1600)]   # 100 MB in 64 KB pieces: on the heap, not mmap
    for b in blocks:
        libc.memset(b, 1, 64 * 1024)
    for b in blocks[:-1]:                                    # the last one pins the top: no trim at free
        libc.free(b)
    before = rss_mb()
    release_free_heap()
    assert rss_mb() < before - 50
    libc.free(blocks[-1])


def test_trim_heap_needs_checkpointing():
    from tformer.training.config import TrainConfig
    with pytest.raises(ConfigError, match="trim_heap=true acts on checkpointed blocks only"):
        TrainConfig(trim_heap=True)
