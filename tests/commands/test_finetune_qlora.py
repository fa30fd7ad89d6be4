"""``tformer finetune --model FILE.gguf --method lora`` over the file's own blocks (QLoRA), end to end on a
random-initialised small Llama written as a Q4_1 GGUF: the run trains over the blocks, its checkpoints hold
the adapters only, resume is exact, and ``--merge`` writes ``merged/`` (float: the dequantised blocks plus
``(alpha/r)·B·A``, checked against ``gguf``'s dequantisation and the PEFT adapter file) and ``merged.gguf``
in the file's block format."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
pytest.importorskip("num2words")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
from finetune_fixtures import tiny_tokenizer  # noqa: E402
from tformer.cli import main  # noqa: E402

QUICK = ["--set", "n_train=60", "--set", "n_test=8", "--set", "eval_exact=4", "--set", "progress=false",
         "--set", "threads=1", "--set", "batch_size=4", "--set", "max_length=48", "--set", "max_number=999",
         "--set", "lora_targets=all", "--set", "lora_r=4", "--set", "lora_alpha=8", "--set", "lr=1e-2",
         "--set", "log_interval=1", "--set", "eval_batches=1", "--set", "precision=fp32"]


@pytest.fixture(scope="module")
def q4_1_file(tmp_path_factory):
    import transformers
    from num2words import num2words
    from tformer.interop.gguf import save_gguf
    from tformer.interop.hf import load_hf
    folder = tmp_path_factory.mktemp("base")
    text = " ".join(f"Write {x} in French words. {num2words(x, lang='fr')}" for x in range(0, 3000, 7))
    vocab = tiny_tokenizer(folder, text + " user assistant system")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   eos_token_id=2, bos_token_id=0, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    path = folder / "tiny.Q4_1.gguf"
    save_gguf(load_hf(folder), path, "q4_1", tokenizer_dir=folder, eos=[2])
    return path


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_qlora_trains_over_the_blocks_resumes_exactly_and_merges(q4_1_file, tmp_path, capsys):
    from safetensors.torch import load_file
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert main(["finetune", "--model", str(q4_1_file), "--out", str(whole), "--merge", *QUICK,
                 "--set", "max_steps=6", "--set", "eval_interval=3"]) == 0
    out = capsys.readouterr().out
    assert "QLoRA: the frozen base is the file's q4_1" in out
    ckpt = next((whole / "ckpt").glob("step-*6"))
    saved = load_file(str(ckpt / "model.safetensors"))
    assert saved and all(".lora_" in k for k in saved)                 # adapters only: the base is the file
    losses = [r["loss"] for r in metrics(whole) if "loss" in r]
    assert len(losses) == 6

    assert main(["finetune", "--model", str(q4_1_file), "--out", str(part), *QUICK, "--set", "max_steps=3",
                 "--set", "eval_interval=3"]) == 0
    assert main(["finetune", "--resume", "--out", str(part), "--set", "max_steps=6", "--set", "progress=false"]) == 0
    got = {r["step"]: r["loss"] for r in metrics(part) if "loss" in r}
    assert got == {r["step"]: r["loss"] for r in metrics(whole) if "loss" in r}

    # merged/ = gguf's dequantisation of the file's blocks + (alpha/r) B A from the PEFT adapter file
    reader = gguf.GGUFReader(str(q4_1_file))
    t = next(x for x in reader.tensors if x.name == "blk.1.ffn_down.weight")
    base = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(64, 128)
    adapter = load_file(str(whole / "adapter" / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.1.mlp.down_proj"
    delta = (8 / 4) * (adapter[f"{key}.lora_B.weight"] @ adapter[f"{key}.lora_A.weight"]).numpy()
    assert np.abs(delta).max() > 1e-4                                    # the adapter did move
    merged = load_file(str(whole / "merged" / "model.safetensors"))
    assert np.allclose(merged["blocks.1.ffn.down.weight"].numpy(), base + delta, atol=1e-6)

    out_reader = gguf.GGUFReader(str(whole / "merged.gguf"))
    kinds = {x.name: x.tensor_type.name for x in out_reader.tensors}
    # a 4-bit base merges into Q8_0 (4 bits again would round the update away)
    assert kinds["blk.1.ffn_down.weight"] == "Q8_0" and kinds["blk.0.attn_q.weight"] == "Q8_0"
    assert "merged.gguf in q8_0, not the base's q4_1" in out
    t2 = next(x for x in out_reader.tensors if x.name == "blk.1.ffn_down.weight")
    back = gguf.quants.dequantize(np.asarray(t2.data), t2.tensor_type).reshape(64, 128)
    merged_w = (base + delta).reshape(64, 4, 32)
    # Q8_0: scale d = max|w|/127 per 32 weights, stored in f16: half a step, plus 127 q's times d's f16 rounding
    half_step = np.abs(merged_w).max(2, keepdims=True) / 127 * (0.5 + 127 * 2**-11)
    assert np.all(np.abs(back.reshape(64, 4, 32) - merged_w) <= half_step + 1e-6)


def test_qlora_false_widens_the_base(q4_1_file, tmp_path, capsys):
    assert main(["finetune", "--model", str(q4_1_file), "--out", str(tmp_path / "w"), *QUICK,
                 "--set", "max_steps=1", "--set", "qlora=false"]) == 0
    assert "QLoRA" not in capsys.readouterr().out


def test_a_file_of_mixed_formats_is_widened_and_says_so(q4_1_file, tmp_path, monkeypatch, capsys):
    """A file whose q, k and v differ in format (as in a Q4_K_M file) opens as a StackedLinear that LoRA cannot
    wrap: the base is widened to float32 and the log says why."""
    from tformer.interop import gguf as gguf_export
    from tformer.interop.hf import load_hf
    from tformer.training.finetune import qlora_dtype
    plain = gguf_export.encode
    monkeypatch.setattr(gguf_export, "encode",      # k and v (32 rows of 64) in Q8_0, the rest in Q4_1
                        lambda a, kind: plain(a, "q8_0" if a.shape == (32, 64) else kind))
    path = tmp_path / "mixed.gguf"
    gguf_export.save_gguf(load_hf(q4_1_file.parent), path, "q4_1", tokenizer_dir=q4_1_file.parent, eos=[2])
    monkeypatch.undo()
    assert qlora_dtype(str(q4_1_file)) == ("q4_1", None)
    assert qlora_dtype(str(path))[0] == "fp32"
    assert main(["finetune", "--model", str(path), "--out", str(tmp_path / "w"), *QUICK, "--set", "max_steps=1"]) == 0
    out = capsys.readouterr().out
    assert "stores its layer matrices as q4_1, q8_0" in out and "widened to float32" in out
    assert "multiplied in float tile by tile" not in out


def test_merged_gguf_greedy_tokens_equal_in_llama_cpp(q4_1_file, tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    from tformer.generation.generate import generate
    from tformer.inference import open_model
    run = tmp_path / "m"
    assert main(["finetune", "--model", str(q4_1_file), "--out", str(run), "--merge", *QUICK,
                 "--set", "max_steps=3", "--set", "lr=5e-2"]) == 0
    path = str(run / "merged.gguf")
    ours = open_model(path)
    assert ours.dtype == "q8_0"                  # a 4-bit base merges into Q8_0 (MERGED_FORMAT)
    llm = llama_cpp.Llama(model_path=path, n_ctx=128, n_threads=1, verbose=False)
    try:
        for prompt in ([1, 5, 7, 9], [3, 40, 41, 42, 43, 44]):
            llm.reset()
            theirs = []
            for tok in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0):
                theirs.append(tok)
                if len(theirs) == 8:
                    break
            mine = generate(ours.model, torch.tensor([prompt]), 8, temperature=0.0)[0, len(prompt):].tolist()
            assert mine == theirs
    finally:
        llm.close()
