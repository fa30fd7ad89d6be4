"""SmolLM2's tokenizer as tformer builds it from the GGUF equals llama.cpp's own on 2,000 varied lines
(``llama_cpp.Llama(..., vocab_only=True).tokenize``), for the file's ``smollm`` pre-tokenizer and for
``gpt-2``, ``llama-bpe`` and ``qwen2`` (SmolLM2's vocabulary written under that name). llama.cpp
implements the splitting regexes in its own C++ (src/unicode.cpp), so this is an independent check
of the split, which transformers' GGUF reader does not implement for ``smollm``.

llama-cpp-python is the `bench` extra (built from source, ~10 min), so this module skips without it.
"""

from __future__ import annotations

import pytest

pytest.importorskip("gguf", reason="the optional extra 'gguf' is not installed")
llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python (the `bench` extra) is not installed")

from test_smollm2 import vocab_file  # noqa: E402
from varied_text import varied_lines  # noqa: E402

from tformer.interop.gguf_import import gguf_tokenizer  # noqa: E402
from tformer.interop.gguf_reader import GGUFFile  # noqa: E402


def check(path, seed: int) -> int:
    ref = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    tok = gguf_tokenizer(GGUFFile(path))
    lines = varied_lines(2000, seed=seed)
    for line in lines:
        want = ref.tokenize(line.encode("utf-8"), add_bos=False, special=False)
        assert tok.encode(line) == want, repr(line)
    specials = "<|im_start|>user\nhello  2<|im_end|>\n"
    assert tok.encode(specials) == ref.tokenize(specials.encode(), add_bos=False, special=True)
    return len(lines)


def test_smollm_tokenizer_equals_llama_cpp(smollm2):
    assert check(smollm2[0], seed=0) == 2000


@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe", "qwen2"])
def test_other_pre_tokenizers_equal_llama_cpp(smollm2, tmp_path, pre):
    assert check(vocab_file(GGUFFile(smollm2[0]), tmp_path / f"vocab-{pre}.gguf", pre), seed=1) == 2000
