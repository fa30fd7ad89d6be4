"""The vocabularies of Llama 3 (``llama-bpe``), Qwen2/3 (``qwen2``) and the SentencePiece kind (Llama 2, Phi-3,
Gemma), trained here (:mod:`trained_vocabs`), tokenize in tformer as in transformers and sentencepiece (in CI)
and llama.cpp (where llama-cpp-python is installed), on 2,000 varied lines each: the GGUF file's tokenizer as
tformer builds it from ``tokenizer.ggml.*``, and the ``tokenizer.json`` as tformer reads it. Phi-3.5's layout
of the SentencePiece kind (``phi``: its chat tokens after the pieces, padding, and the whitespace after a marker
stripped, by llama.cpp because the file's name says Phi-3, by transformers by the tokens' ``rstrip``) too.

Qwen's ``tokenizer.json`` normalizes text to NFC and llama.cpp does not: a GGUF file tokenizes as llama.cpp
does, so it is compared with transformers on the lines normalized first (61 of the 2,000 change).
"""

from __future__ import annotations

import unicodedata

import pytest

pytest.importorskip("gguf", reason="the optional extra 'gguf' is not installed")
transformers = pytest.importorskip("transformers")

from trained_vocabs import bpe_files, phi_files, spm_files, spm_model  # noqa: E402
from varied_text import varied_lines  # noqa: E402

from tformer.errors import CheckpointError  # noqa: E402
from tformer.interop.gguf_import import gguf_tokenizer  # noqa: E402
from tformer.interop.gguf_reader import GGUFFile  # noqa: E402
from tformer.tokenizers import gguf_bpe_tokenizer, load_tokenizer  # noqa: E402

LINES = varied_lines(2000, seed=0)
CHAT = {"llama-bpe": "<|start_header_id|>user<|end_header_id|>\n\nhi 123<|eot_id|>",
        "qwen2": "<|im_start|>user\n<think>\nhello  2</think><|im_end|>\n",
        "spm": "<start_of_turn>user\nhi  there<end_of_turn>\n<|user|> a<|end|>",
        "phi": "<|system|>\t \r\nBe brief.<|end|>\n<|user|>\nhi  there 2024<|end|>\n\n<|assistant|>\n"}


@pytest.fixture(scope="module", params=["llama-bpe", "qwen2", "spm-prefix", "spm-gemma", "phi"])
def family(request, tmp_path_factory):
    """``(name, tformer from GGUF, tformer from tokenizer.json, transformers' tokenizer, GGUF path)``."""
    name, folder = request.param, tmp_path_factory.mktemp(request.param)
    if name == "phi":
        path, hf = phi_files(folder)
    elif name.startswith("spm"):
        path, hf = spm_files(folder, name == "spm-prefix")
    else:
        path, hf = bpe_files(folder, name)
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=str(hf))
    return name, gguf_tokenizer(GGUFFile(path)), load_tokenizer(hf), ref, path


def test_ids_equal_transformers(family):
    name, from_gguf, from_json, ref, _ = family
    for line in LINES:
        want = ref.encode(line, add_special_tokens=False)
        assert from_json.encode(line, add_special_tokens=False) == want, repr(line)
        nfc = unicodedata.normalize("NFC", line) if name == "qwen2" else line     # what Qwen's normalizer does
        assert from_gguf.encode(nfc, add_special_tokens=False) == want, repr(line)
        assert from_gguf.decode(want) == ref.decode(want), repr(line)
    chat = CHAT["spm" if name.startswith("spm") else name]
    assert from_gguf.encode(chat) == from_json.encode(chat) == ref.encode(chat)       # BOS as the file says
    if name == "phi":                                   # no whitespace token after a marker
        assert from_gguf.encode(chat, add_special_tokens=False)[:2] == [from_gguf.tok.token_to_id("<|system|>"),
                                                                         from_gguf.tok.token_to_id("▁Be")]
    assert from_gguf.decode(ref.encode(chat), skip_special_tokens=False) == ref.decode(ref.encode(chat))


def test_decode_round_trips(family):
    """``decode(encode(x)) == x``: transformers round-trips each of these lines, and so does tformer."""
    name, from_gguf, _, ref, _ = family
    for line in LINES:
        if name == "qwen2" and unicodedata.normalize("NFC", line) != line:
            continue
        assert ref.decode(ref.encode(line, add_special_tokens=False)) == line
        assert from_gguf.decode(from_gguf.encode(line)) == line, repr(line)


@pytest.mark.parametrize("name, strips", [("phi-3.5-mini", True), ("Phi3", True), ("Phi 3.5 Mini Instruct", False),
                                          ("llama-2", False)])
def test_phi_markers_strip_the_whitespace_after_them_as_the_files_name_says(tmp_path, name, strips):
    """llama.cpp strips the whitespace after Phi's markers when ``general.name`` holds ``phi-3`` or ``phi3`` (any
    case): a file named "Phi 3.5 Mini Instruct" keeps it. tformer reads the name the same way; where
    llama-cpp-python is installed, its ids are the reference, else the ids with and without the markers' rstrip."""
    path, _ = phi_files(tmp_path, name=name)
    tok = gguf_tokenizer(GGUFFile(path))
    chat = CHAT["phi"]
    ids = tok.encode(chat)
    stripped = chat.replace("|>\t \r\n", "|>").replace("|>\n\n", "|>").replace("|>\n", "|>")
    assert (ids == tok.encode(stripped)) == strips
    try:
        import llama_cpp
    except ImportError:
        return
    assert ids == llama_cpp.Llama(str(path), vocab_only=True, verbose=False).tokenize(chat.encode(), special=True)


@pytest.mark.parametrize("prefix", [True, False])
def test_sentencepiece_ids_equal_the_sentencepiece_library(tmp_path, prefix):
    """The reference implementation of the model kind itself (Google's sentencepiece), in CI."""
    import sentencepiece
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(spm_model())
    proto.normalizer_spec.add_dummy_prefix = prefix
    sp = sentencepiece.SentencePieceProcessor(model_proto=proto.SerializeToString())
    path, _ = spm_files(tmp_path, prefix)
    tok = gguf_tokenizer(GGUFFile(path))
    for line in LINES:
        ids = sp.encode(line)
        assert tok.encode(line, add_special_tokens=False) == ids, repr(line)
        assert tok.decode(ids) == sp.decode(ids)


def test_an_unknown_pre_tokenizer_is_refused_in_one_sentence():
    with pytest.raises(CheckpointError, match="tokenizer.ggml.pre='tekken' names a pre-tokenizer") as e:
        gguf_bpe_tokenizer(["a", "b", "ab"], ["a b"], None, "tekken")
    assert "\n" not in str(e.value)


def test_sentencepiece_without_scores_is_refused(tmp_path):
    from trained_vocabs import write_gguf

    path = write_gguf(tmp_path / "x.gguf", "llama", ["<unk>", "a"], [2, 1])
    with pytest.raises(CheckpointError, match="tokenizer.ggml.scores must hold one number per token"):
        gguf_tokenizer(GGUFFile(path))


def test_ids_equal_llama_cpp(family):
    """llama.cpp's own tokenizer (src/llama-vocab.cpp, its regexes in src/unicode.cpp): independent C++."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python (the `bench` extra) is not installed")
    name, from_gguf, _, _, path = family
    ref = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    for line in LINES:
        want = ref.tokenize(line.encode("utf-8"), add_bos=False, special=False)
        assert from_gguf.encode(line, add_special_tokens=False) == want, repr(line)
        if name == "phi":        # no BOS in Phi's file: llama.cpp's own llama_detokenize drops the prefix space
            assert from_gguf.decode(want).encode("utf-8") == llama_detokenize(ref, want), repr(line)
            continue
        # the binding drops the text's first space after a BOS (what llama.cpp does for add_space_prefix)
        ids = ref.tokenize(line.encode("utf-8"), add_bos=name == "spm-prefix", special=False)
        assert from_gguf.decode(ids).encode("utf-8") == ref.detokenize(ids), repr(line)
    chat = CHAT["spm" if name.startswith("spm") else name]
    assert from_gguf.encode(chat) == ref.tokenize(chat.encode(), add_bos=True, special=True)    # BOS as the file says
    assert from_gguf.encode(chat, parse_special=False) == ref.tokenize(chat.encode(), add_bos=True, special=False)


def llama_detokenize(ref, ids: list[int]) -> bytes:
    """llama.cpp's ``llama_detokenize`` (special tokens left out) of ``ids`` on the ``llama_cpp.Llama`` ``ref``."""
    import ctypes

    import llama_cpp

    buf = ctypes.create_string_buffer(16 * len(ids) + 16)
    n = llama_cpp.llama_detokenize(ref._model.vocab, (llama_cpp.llama_token * len(ids))(*ids), len(ids), buf,
                                   len(buf), True, False)
    return buf.raw[:n]


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
def test_export_names_the_pre_tokenizer_by_the_tokenizer_json(tmp_path, pre):
    """`tformer convert --to-gguf` writes tokenizer.ggml.pre from the tokenizer.json's split, and the file it
    writes tokenizes as transformers does."""
    import gguf

    from tformer.interop.gguf import hf_bpe_tokenizer, write_tokenizer

    _, hf = bpe_files(tmp_path / "hf", pre)
    tok = hf_bpe_tokenizer(hf.parent)
    assert tok["gguf_pre"] == pre
    w = gguf.GGUFWriter(str(tmp_path / "out.gguf"), "llama")
    write_tokenizer(w, tok, "llama", len(tok["model"]["vocab"]) + len(tok["added_tokens"]), [])
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    ours = gguf_tokenizer(GGUFFile(tmp_path / "out.gguf"))
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=str(hf))
    for line in LINES[:300]:
        line = unicodedata.normalize("NFC", line)
        assert ours.encode(line, add_special_tokens=False) == ref.encode(line, add_special_tokens=False), repr(line)


def test_export_refuses_a_split_or_a_vocabulary_llama_cpp_would_read_otherwise(tmp_path):
    import json

    from tformer.errors import InputError
    from tformer.interop.gguf import hf_bpe_tokenizer

    _, hf = bpe_files(tmp_path / "bpe", "llama-bpe")
    data = json.loads(hf.read_text())
    data["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\p{L}+|\p{N}{1,4}|\s+"
    hf.write_text(json.dumps(data))
    with pytest.raises(InputError, match="none llama.cpp has a name for"):
        hf_bpe_tokenizer(hf.parent)
    _, hf = spm_files(tmp_path / "spm", True)
    with pytest.raises(InputError, match="SentencePiece-style BPE"):
        hf_bpe_tokenizer(hf.parent)


def test_a_sentencepiece_gguf_converts_to_a_checkpoint_tokenizer_that_reads_back_equal(tmp_path):
    """What `tformer convert --from-gguf` writes (tokenizer.json, tokenizer_config.json) for such a vocabulary."""
    from tformer.interop.gguf_import import tokenizer_config

    path, _ = spm_files(tmp_path / "spm", True)
    f = GGUFFile(path)
    tok = gguf_tokenizer(f)
    tok.save(tmp_path / "tokenizer.json")
    again = load_tokenizer(tmp_path / "tokenizer.json")
    for line in LINES[:300]:
        assert again.encode(line) == tok.encode(line) and again.encode(line)[0] == 1     # BOS, as llama.cpp adds it
    config = tokenizer_config(f)
    assert config["add_bos_token"] is True and config["bos_token"] == "<s>" and config["eos_token"] == "</s>"


@pytest.mark.parametrize("template, prefix", [("phi-3.5", True), ("gemma-3", False)])
def test_a_sentencepiece_gguf_chat_prompt_equals_transformers_and_stops_at_its_end_of_turn(tmp_path, template, prefix):
    """The rendered chat's ids from the GGUF tokenizer (each piece between the template's markers gets the prefix
    space, as llama.cpp gives it after a special token) equal transformers' apply_chat_template(tokenize=True) on
    the same vocabulary's tokenizer.json, and llama.cpp's where installed; the end-of-turn token stops."""
    from pathlib import Path

    from tformer.inference import end_of_turn_ids
    from tformer.tokenizers import ChatTemplate

    source = (Path(__file__).parents[1] / "data" / "chat_templates" / f"{template}.jinja").read_text(encoding="utf-8")
    path, hf = spm_files(tmp_path, prefix)
    tok = gguf_tokenizer(GGUFFile(path))
    special = {"bos_token": "<s>", "eos_token": "</s>"}
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=str(hf), chat_template=source, **special)
    ours = ChatTemplate(source, **special)
    chat = [{"role": "user", "content": "  Hello there, 日本 🙂\n"}, {"role": "assistant", "content": "Hi! 12345"},
            {"role": "user", "content": "typed <end_of_turn> <|end|> stays text"}]
    ids = ours.encode(tok, chat)
    want = ref.apply_chat_template(chat, tokenize=True, add_generation_prompt=True, return_dict=False)
    marker = {"phi-3.5": "<|end|>", "gemma-3": "<end_of_turn>"}[template]
    turn = tok.tok.token_to_id(marker)
    assert ids.count(turn) == want.count(turn) - 1 == 3          # transformers parses the typed marker; tformer not
    assert ours.encode(tok, chat, parse_special=True) == want
    assert turn in end_of_turn_ids(ours, tok)
    try:
        import llama_cpp
    except ImportError:
        return
    lc = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    text = ours.render(chat)
    assert ours.encode(tok, chat, parse_special=True) == lc.tokenize(text.encode(), add_bos=False, special=True)
