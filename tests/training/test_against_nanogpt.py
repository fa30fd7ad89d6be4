"""tformer's training step against nanoGPT's own code, an independent implementation: the same weights,
the same batches, ``recipe=classic`` (nanoGPT's architecture and AdamW recipe) without dropout, so the
two must follow one trajectory.

nanoGPT is ``../shared/peers/nanoGPT`` (unmodified, not in this repository); the test is skipped where
that checkout is absent. Its ``model.py`` is imported as it is; its optimizer is its own
``configure_optimizers`` (weight decay on 2-D tensors only), its step the one ``train.py`` takes
(backward, clip at 1.0, AdamW, zero_grad). tformer's step is ``Trainer._train_step`` on the batches its
own task draws. Tolerance: float32 sums in a different order (PyTorch's SDPA in nanoGPT; tformer's own
CPU attention kernel, or PyTorch's) keep the two within 1e-5 in loss and in every weight over 6 AdamW
steps at lr 1e-3 (measured: weights 5e-7 apart with tformer's kernel, 4e-8 with PyTorch's); β2 at
0.95 instead of 0.99 on one side moves the loss by 1.8e-4 at the third step.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tformer.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
NANOGPT = next((p / "peers" / "nanoGPT" for p in (ROOT.parent / "shared", ROOT.parent.parent / "shared")
                if (p / "peers" / "nanoGPT" / "model.py").is_file()), None)
pytestmark = pytest.mark.skipif(NANOGPT is None, reason="../shared/peers/nanoGPT is not here")

SHAPE = dict(n_layers=2, n_heads=4, d_model=64, context_length=32, batch_size=4)


def _nanogpt_module():
    spec = importlib.util.spec_from_file_location("nanogpt_model", NANOGPT / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _names(n_layers: int) -> dict[str, str]:
    """tformer's parameter name -> nanoGPT's (both keep Linear's (out, in) layout; the qkv projection
    is one [q; k; v] matrix in both; the head is tied to the token embedding in both)."""
    names = {"tok_emb.weight": "transformer.wte.weight", "pos_emb.weight": "transformer.wpe.weight",
             "final_norm.weight": "transformer.ln_f.weight"}
    for i in range(n_layers):
        for ours, theirs in (("attn_norm", "ln_1"), ("attn.qkv_proj", "attn.c_attn"), ("attn.out_proj", "attn.c_proj"),
                             ("ffn_norm", "ln_2"), ("ffn.up", "mlp.c_fc"), ("ffn.down", "mlp.c_proj")):
            names[f"blocks.{i}.{ours}.weight"] = f"transformer.h.{i}.{theirs}.weight"
    return names


@pytest.mark.parametrize("backend", ["auto", "torch"])     # tformer's CPU attention kernel, and PyTorch's
def test_the_classic_step_follows_nanogpts_trajectory(tmp_path, backend):
    text = "".join(f"{i}: a small corpus, written for this test, of {i * 7 % 13} lines.\n" for i in range(200))
    (tmp_path / "corpus.txt").write_text(text)
    tr = Trainer.create({**SHAPE, "recipe": "classic", "dropout": 0.0, "bias": False, "tokenizer": "char",
                         "lr": 1e-3, "beta2": 0.99, "weight_decay": 0.1, "grad_clip": 1.0, "precision": "fp32",
                         "threads": 1, "sample_tokens": 0, "progress": False, "attention_backend": backend,
                         "data": str(tmp_path / "corpus.txt"), "out_dir": str(tmp_path / "run"),
                         "cache_dir": str(tmp_path / "cache")}, log=lambda m: None)
    model = _nanogpt_module()
    torch.manual_seed(1337)
    nano = model.GPT(model.GPTConfig(block_size=SHAPE["context_length"], vocab_size=tr.corpus.tokenizer.vocab_size,
                                     n_layer=SHAPE["n_layers"], n_head=SHAPE["n_heads"], n_embd=SHAPE["d_model"],
                                     dropout=0.0, bias=False))
    names, theirs = _names(SHAPE["n_layers"]), dict(nano.named_parameters())
    theirs["transformer.wte.weight"] = nano.transformer.wte.weight      # tied to lm_head, listed once
    ours = dict(tr.model.named_parameters())
    assert sorted(ours) == sorted(names), "tformer's classic model and nanoGPT's differ in their parameters"
    with torch.no_grad():
        for name, p in ours.items():
            p.copy_(theirs[names[name]])
    opt = nano.configure_optimizers(0.1, 1e-3, (0.9, 0.99), "cpu")
    for step in range(6):
        (_, (x, y), _), = list(tr.task.pieces(tr.step, tr.dist))           # the batch tformer's step will take
        _, loss = nano(x.contiguous(), y.contiguous())              # nanoGPT views its targets
        loss.backward()
        torch.nn.utils.clip_grad_norm_(nano.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = tr._train_step(1e-3)
        tr.step += 1
        assert mean == pytest.approx(loss.item(), abs=1e-5), f"step {step}"
    moved = max((p - theirs[names[name]]).abs().max().item() for name, p in ours.items())
    assert moved < 1e-5                                  # measured: 5e-7 (auto), 4e-8 (torch)
