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


def test_a_character_model_generates_through_the_cli_as_nanogpt_does(tmp_path, capsys):
    """With --vocab-text the folder carries nanoGPT's character vocabulary (sorted distinct characters of
    the text, as its prepare.py builds it), so `tformer generate` continues a prompt; greedy, the text
    equals what nanoGPT's own generate() gives with top_k=1 on ids encoded as prepare.py encodes them."""
    text = "".join(f"to be, or not {i}; that is the question {i * 3 % 7}.\n" for i in range(40))
    (tmp_path / "input.txt").write_text(text)
    chars = sorted(set(text))                                   # nanoGPT's prepare.py
    stoi = {c: i for i, c in enumerate(chars)}
    nano = nanogpt_model()
    torch.manual_seed(5)
    args = dict(n_layer=2, n_head=2, n_embd=32, block_size=32, bias=False, vocab_size=len(chars), dropout=0.0)
    model = nano.GPT(nano.GPTConfig(**args))
    opt = model.configure_optimizers(0.0, 3e-3, (0.9, 0.99), "cpu")
    data = torch.tensor([stoi[c] for c in text])
    for step in range(60):                                      # enough that greedy text is not one letter
        i = torch.randint(0, len(data) - 33, (8,))
        x = torch.stack([data[j:j + 32] for j in i])
        y = torch.stack([data[j + 1:j + 33] for j in i])
        model(x, y)[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()
    torch.save({"model": model.state_dict(), "model_args": args}, tmp_path / "ckpt.pt")
    assert main(["convert", "--from-nanogpt", str(tmp_path / "ckpt.pt"), "--out", str(tmp_path / "out"),
                 "--vocab-text", str(tmp_path / "input.txt")]) == 0
    assert f"a {len(chars)}-character tokenizer" in capsys.readouterr().out
    prompt = "to be, or"
    with torch.no_grad():
        ids = model.generate(torch.tensor([[stoi[c] for c in prompt]]), 20, top_k=1)[0].tolist()
    theirs = "".join(chars[i] for i in ids)
    assert main(["generate", "--ckpt", str(tmp_path / "out"), "--prompt", prompt, "--max-new-tokens", "20",
                 "--temperature", "0", "--ignore-eos"]) == 0
    ours = capsys.readouterr().out                              # the continuation, then print's newline
    assert ours.endswith("\n") and prompt + ours[:-1] == theirs, (ours, theirs)
    assert len(set(theirs[len(prompt):])) > 2


def test_vocab_text_must_fit_the_model(tmp_path, capsys):
    _checkpoint(tmp_path / "ckpt.pt", bias=False)                       # vocabulary 50
    (tmp_path / "few.txt").write_text("abc")
    assert main(["convert", "--from-nanogpt", str(tmp_path / "ckpt.pt"), "--out", str(tmp_path / "o"),
                 "--vocab-text", str(tmp_path / "few.txt")]) == 2
    err = capsys.readouterr().err
    assert "3 distinct characters but the model's vocabulary is 50" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()
    assert main(["convert", "--from-hf", str(tmp_path), "--out", str(tmp_path / "o2"),
                 "--vocab-text", str(tmp_path / "few.txt")]) == 2
    assert "--vocab-text applies to --from-nanogpt only" in capsys.readouterr().err
