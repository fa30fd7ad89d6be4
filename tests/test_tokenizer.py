"""Tokenizers: round trips (char and byte-level BPE), non-ASCII and invalid bytes, save/load."""

import pytest

from tformer.training.data import load_corpus
from tformer.tokenizers import (BPETokenizer, CharTokenizer, clean_text, load_tokenizer,
                                        tokenizer_from_dict)

TEXT = ("def f(x):\n\treturn x * 2  # double\r\n"
        "Grüße, naïve café — 日本語のテキスト, emoji 🙂🚀, math ∑∫√, nul \x00 and U+FFFD \ufffd.\n") * 20


def test_char_ids_are_indices_into_sorted_vocabulary():
    """Reference: the id of a character is its index in sorted(set(text))."""
    tok = CharTokenizer.train(TEXT)
    ref = sorted(set(TEXT))
    assert tok.encode(TEXT) == [ref.index(c) for c in TEXT]
    assert tok.decode(tok.encode(TEXT)) == TEXT


def test_char_unknown_character_is_a_clear_error():
    tok = CharTokenizer.train("abc")
    with pytest.raises(ValueError, match="not in this character vocabulary"):
        tok.encode("abz")


def test_bpe_round_trip_and_compression(tmp_path):
    tok = BPETokenizer.train(TEXT, vocab_size=400)
    assert 256 <= tok.vocab_size <= 400
    for s in (TEXT, "unseen words: Ærøskøbing ქართული 🦜", "", " leading and trailing  ", "\r\n\t"):
        assert tok.decode(tok.encode(s)) == s
    assert len(tok.encode(TEXT)) < len(TEXT.encode("utf-8")) / 2      # merges were learned
    tok.save(tmp_path / "tokenizer.json")
    again = load_tokenizer(tmp_path)
    assert again.encode(TEXT) == tok.encode(TEXT)
    assert tokenizer_from_dict(tok.to_dict()).decode(tok.encode(TEXT)) == TEXT


def test_bpe_vocab_too_small_is_a_clear_error():
    with pytest.raises(ValueError, match="at least 256"):
        BPETokenizer.train("abc", vocab_size=100)


def test_invalid_bytes_in_strings_become_replacement_characters():
    smuggled = b"ab\xff\xfecd".decode("utf-8", "surrogateescape")      # as sys.argv carries bad bytes
    assert clean_text(smuggled) == "ab\ufffd\ufffdcd"
    assert clean_text("plain ü") == "plain ü"
    tok = BPETokenizer.train("abcd", vocab_size=260)
    assert tok.decode(tok.encode(smuggled)) == "ab\ufffd\ufffdcd"


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_corpus_with_invalid_utf8_trains_and_round_trips(tmp_path, kind):
    raw = ("good text é " * 30).encode() + b"\xff\xfe\xc3(bad)\x80" + ("more 日本 " * 30).encode()
    (tmp_path / "c.txt").write_bytes(raw)
    corpus = load_corpus(str(tmp_path / "c.txt"), tokenizer=kind, bpe_vocab_size=300, val_fraction=0.1,
                         cache_dir=tmp_path / "cache", log=lambda m: None)
    ids = list(corpus.train) + list(corpus.val)
    text = corpus.tokenizer.decode(ids)
    assert text == raw.decode("utf-8", "replace")                       # each bad byte -> U+FFFD
    assert corpus.tokenizer.encode(text) == [int(i) for i in ids]


def test_a_huggingface_tokenizer_json_loads_as_is(tmp_path):
    """A `tokenizers` file (as HF folders ship it, and `tformer convert` copies it) is read directly."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from tformer.tokenizers import load_tokenizer

    hf = Tokenizer(models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path)
    assert tok.vocab_size == 3 and tok.kind == "tokenizers"
    assert tok.encode("hello world") == hf.encode("hello world").ids == [0, 1]
    assert tok.decode([1, 0]) == hf.decode([1, 0])


def test_a_chat_template_in_its_own_file_is_found_and_converted_along(tmp_path):
    """transformers 5 saves the template as chat_template.jinja, not in tokenizer_config.json."""
    from tformer.commands.convert import copy_side_files
    from tformer.tokenizers import load_chat_template

    hf, ours = tmp_path / "hf", tmp_path / "ckpt"
    hf.mkdir(), ours.mkdir()
    (hf / "chat_template.jinja").write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    assert load_chat_template(ours) is None
    assert "chat_template.jinja" in copy_side_files(hf, ours)
    template = load_chat_template(ours)
    assert template is not None and template.render([{"role": "user", "content": "hi"}]).startswith("<user>hi")
