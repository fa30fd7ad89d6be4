"""nanoGPT's ``ckpt.pt`` into tformer (``tformer.interop.nanogpt``, ``tformer convert --from-nanogpt``):
the logits of nanoGPT's own ``model.py`` on the same ids, from a checkpoint laid out as its
``train.py`` saves one (``model``, ``optimizer``, ``model_args``, ``iter_num``, ``best_val_loss``,
``config``). Tolerance 1e-5 on logits of magnitude ~1 (two float32 programs, different summation
orders: PyTorch's SDPA in nanoGPT's attention, tformer's own in eval)."""

from __future__ import annotations

import pytest
import torch

from tformer.checkpoint import load_model
from tformer.cli import main
from tformer.errors import CheckpointError
from tformer.interop.nanogpt import load_nanogpt

from tests.peers import nanogpt_model, needs_nanogpt

pytestmark = needs_nanogpt


def _checkpoint(path, bias: bool, compiled: bool = False):
    """A nanoGPT model trained for a few steps (so no weight is at its initial value) and saved the way
    nanoGPT's train.py saves it; returns the model."""
    nano = nanogpt_model()
    torch.manual_seed(3)
    args = dict(n_layer=2, n_head=4, n_embd=32, block_size=16, bias=bias, vocab_size=50, dropout=0.0)
    model = nano.GPT(nano.GPTConfig(**args))
    opt = model.configure_optimizers(0.1, 1e-2, (0.9, 0.99), "cpu")
    for _ in range(3):
        x = torch.randint(0, 50, (2, 16))
        model(x, torch.roll(x, -1, 1))[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = model.state_dict()
    if compiled:                                            # how a torch.compile'd run names its tensors
        state = {f"_orig_mod.{k}": v for k, v in state.items()}
    torch.save({"model": state, "optimizer": opt.state_dict(), "model_args": args, "iter_num": 3,
                "best_val_loss": torch.tensor(3.2), "config": {"dataset": "shakespeare_char", "compile": compiled}},
               path)
    return model.eval()


def _nanogpt_logits(model, ids):
    with torch.no_grad():
        return model(ids, torch.zeros_like(ids))[0]          # with targets it returns every position's logits


@pytest.mark.parametrize("bias,compiled", [(False, False), (True, False), (False, True)])
def test_the_import_gives_nanogpts_logits(tmp_path, bias, compiled):
    nano = _checkpoint(tmp_path / "ckpt.pt", bias, compiled)
    model = load_nanogpt(tmp_path / "ckpt.pt")
    assert model.config.activation == "gelu" and model.config.bias is bias and model.config.tie_embeddings
    ids = torch.randint(0, 50, (3, 16))
    with torch.no_grad():
        ours = model(ids)[0]
    theirs = _nanogpt_logits(nano, ids)
    assert theirs.abs().max() > 0.1
    assert (ours - theirs).abs().max() < 1e-5


def test_the_command_writes_a_checkpoint_folder(tmp_path, capsys):
    nano = _checkpoint(tmp_path / "ckpt.pt", bias=False)
    assert main(["convert", "--from-nanogpt", str(tmp_path / "ckpt.pt"), "--out", str(tmp_path / "out")]) == 0
    assert "no tokenizer" in capsys.readouterr().out
    model = load_model(tmp_path / "out")
    ids = torch.randint(0, 50, (1, 16))
    with torch.no_grad():
        assert (model(ids)[0] - _nanogpt_logits(nano, ids)).abs().max() < 1e-5


def test_bad_files_are_refused_in_one_sentence(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    assert main(["convert", "--from-nanogpt", str(tmp_path / "notes.txt"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "does not load as a torch checkpoint" in err and len(err.strip().splitlines()) == 1
    torch.save({"weights": {}}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="no 'model' and 'model_args'"):
        load_nanogpt(tmp_path / "other.pt")
    _checkpoint(tmp_path / "ckpt.pt", bias=False)
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    ckpt["model"]["transformer.h.0.extra.weight"] = torch.zeros(2)            # a tensor nobody maps
    torch.save(ckpt, tmp_path / "extra.pt")
    with pytest.raises(CheckpointError, match="unexpected tensor.*h.0.extra.weight"):
        load_nanogpt(tmp_path / "extra.pt")
    with pytest.raises(CheckpointError, match="is not a file"):
        load_nanogpt(tmp_path / "missing.pt")
