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

import pytest
import torch

from tformer.interop.nanogpt import state_from_nanogpt
from tformer.training.trainer import Trainer

from tests.peers import nanogpt_model, needs_nanogpt

pytestmark = needs_nanogpt

SHAPE = dict(n_layers=2, n_heads=4, d_model=64, context_length=32, batch_size=4)


@pytest.mark.parametrize("backend", ["auto", "torch"])     # tformer's CPU attention kernel, and PyTorch's
def test_the_classic_step_follows_nanogpts_trajectory(tmp_path, backend):
    text = "".join(f"{i}: a small corpus, written for this test, of {i * 7 % 13} lines.\n" for i in range(200))
    (tmp_path / "corpus.txt").write_text(text)
    tr = Trainer.create({**SHAPE, "recipe": "classic", "dropout": 0.0, "bias": False, "tokenizer": "char",
                         "lr": 1e-3, "beta2": 0.99, "weight_decay": 0.1, "grad_clip": 1.0, "precision": "fp32",
                         "threads": 1, "sample_tokens": 0, "progress": False, "attention_backend": backend,
                         "data": str(tmp_path / "corpus.txt"), "out_dir": str(tmp_path / "run"),
                         "cache_dir": str(tmp_path / "cache")}, log=lambda m: None)
    model = nanogpt_model()
    torch.manual_seed(1337)
    nano = model.GPT(model.GPTConfig(block_size=SHAPE["context_length"], vocab_size=tr.corpus.tokenizer.vocab_size,
                                     n_layer=SHAPE["n_layers"], n_head=SHAPE["n_heads"], n_embd=SHAPE["d_model"],
                                     dropout=0.0, bias=False))
    tr.model.load_state_dict(state_from_nanogpt(nano.state_dict(), tr.model.config), strict=True)
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
    theirs = state_from_nanogpt(nano.state_dict(), tr.model.config)
    moved = max((p - theirs[name]).abs().max().item() for name, p in tr.model.state_dict().items())
    assert moved < 1e-5                                  # measured: 5e-7 (auto), 4e-8 (torch)
