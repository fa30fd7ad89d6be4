"""Small vocabularies of each family's kind, trained here (no download), written as a GGUF file (with the
``gguf`` package, the keys llama.cpp's convert_hf_to_gguf.py writes) and as an HF ``tokenizer.json`` (laid
out as the family's published one):

- ``llama-bpe`` (Llama 3) and ``qwen2`` (Qwen2/2.5/3): byte-level BPE learned by ``tokenizers`` on text
  split by the family's regular expression; Llama 3's file ignores merges for whole-token pieces and adds
  ``<|begin_of_text|>``, Qwen's normalizes to NFC and adds nothing;
- SentencePiece (Llama 2, Phi-3, Gemma): a BPE model with byte fallback learned by ``sentencepiece``;
  its ``tokenizer.json`` has transformers' merges (``generate_merges``) and the Llama 2 / Phi-3
  normalizer (a ``▁`` prepended, spaces as ``▁``) or Gemma's (spaces as ``▁`` only);
- Phi-3.5's layout of it (:func:`phi_pieces`): the pieces, then Phi's eleven added chat tokens as control
  tokens after them (``<|endoftext|>`` first, as at id 32,000 of the published 32,064), then padding; the
  GGUF file named as Phi's (``general.name``), which llama.cpp reads to strip the whitespace after each
  special token but ``<unk>``, ``<s>`` and ``<|endoftext|>``, as the ``rstrip`` of Phi's ``tokenizer.json``.

Training text: the start of tinyshakespeare where ``shared/data`` is beside the repository, and varied
lines of another seed than the tests' (digits, code, scripts, emoji, whitespace runs, contractions).
"""

from __future__ import annotations

import functools
import io
import json
from pathlib import Path

from varied_text import varied_lines

SHAKESPEARE = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "tinyshakespeare.txt"
# The split expressions as the families' tokenizer.json files write them (transformers' too)
HF_SPLITS = {
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+",
}
SPECIALS = {
    "llama-bpe": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                  "<|python_tag|>"],
    "qwen2": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>"],
}
USER_DEFINED = {"qwen2": {"<tool_call>", "</tool_call>", "<think>", "</think>"}}   # Qwen3 marks these not special
SPM_SPECIALS = ["<start_of_turn>", "<end_of_turn>", "<|user|>", "<|assistant|>", "<|end|>", "<|system|>"]
# microsoft/Phi-3.5-mini-instruct's added tokens, ids 32,000 to 32,010 in order (its added_tokens.json)
PHI_ADDED = ["<|endoftext|>", "<|assistant|>", "<|placeholder1|>", "<|placeholder2|>", "<|placeholder3|>",
             "<|placeholder4|>", "<|system|>", "<|end|>", "<|placeholder5|>", "<|placeholder6|>", "<|user|>"]
PHI_NO_RSTRIP = {"<unk>", "<s>", "<|endoftext|>"}        # the special tokens Phi's tokenizer.json does not rstrip


def corpus() -> list[str]:
    lines = SHAKESPEARE.read_text(encoding="utf-8")[:300_000].splitlines() if SHAKESPEARE.is_file() else []
    return lines + varied_lines(3000, seed=7)


def write_gguf(path: Path, model: str, tokens: list[str], types: list[int], **keys) -> Path:
    """A vocabulary-only GGUF (``llama`` architecture, no tensors: llama.cpp opens it with vocab_only)."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("llama.block_count", 1), ("llama.context_length", 64), ("llama.embedding_length", 64),
                       ("llama.feed_forward_length", 64), ("llama.attention.head_count", 1)):
        w.add_uint32(key, value)
    w.add_tokenizer_model(model)
    w.add_token_list(tokens)
    w.add_token_types(types)
    for name, value in keys.items():
        getattr(w, f"add_{name}")(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ------------------------------------------------------------------ byte-level BPE (llama-bpe, qwen2)
@functools.lru_cache(maxsize=None)
def bpe_json(pre: str, vocab_size: int = 3000) -> str:
    """The family's ``tokenizer.json`` text, with a vocabulary learned on :func:`corpus`."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers import trainers

    tok = Tokenizer(models.BPE(ignore_merges=pre == "llama-bpe"))
    tok.normalizer = normalizers.NFC() if pre == "qwen2" else None
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(HF_SPLITS[pre]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    user = USER_DEFINED.get(pre, set())
    tok.add_tokens([AddedToken(t, special=t not in user, normalized=False) for t in SPECIALS[pre]])
    if pre == "llama-bpe":                      # Llama 3 puts <|begin_of_text|> before every text
        bos = SPECIALS[pre][0]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos}:0 $A:0",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok.to_str()


def bpe_files(folder: Path, pre: str) -> tuple[Path, Path]:
    """``(GGUF file, tokenizer.json)`` of the ``pre`` family's trained vocabulary in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    text = bpe_json(pre)
    hf = folder / "tokenizer.json"
    hf.write_text(text, encoding="utf-8")
    data = json.loads(text)
    vocab = dict(data["model"]["vocab"]) | {a["content"]: a["id"] for a in data["added_tokens"]}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"]: a["special"] for a in data["added_tokens"]}
    types = [(3 if special[t] else 4) if t in special else 1 for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    first, eot = SPECIALS[pre][0], {"llama-bpe": "<|eot_id|>", "qwen2": "<|im_end|>"}[pre]
    path = write_gguf(folder / f"{pre}.gguf", "gpt2", tokens, types, tokenizer_pre=pre, token_merges=merges,
                      bos_token_id=vocab[first], eos_token_id=vocab[eot], eot_token_id=vocab[eot],
                      add_bos_token=pre == "llama-bpe")
    return path, hf


# ------------------------------------------------------------------ SentencePiece (Llama 2 / Phi-3, Gemma)
@functools.lru_cache(maxsize=None)
def spm_model(vocab_size: int = 3000, markers: bool = True) -> bytes:
    """A SentencePiece BPE model with byte fallback (as Llama 2's and Gemma's), serialized; ``markers``: the
    chat markers :data:`SPM_SPECIALS` among its pieces (Phi's come after them instead, :func:`phi_pieces`)."""
    import sentencepiece as spm

    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus()), model_writer=out, model_type="bpe", vocab_size=vocab_size, byte_fallback=True,
        character_coverage=0.9995, split_digits=True, allow_whitespace_only_pieces=True, remove_extra_whitespaces=False,
        normalization_rule_name="identity", user_defined_symbols=SPM_SPECIALS if markers else [], num_threads=1,
        minloglevel=2)
    return out.getvalue()


def spm_pieces(vocab_size: int = 3000, markers: bool = True) -> tuple[list[str], list[float], list[int]]:
    """``(tokens, scores, types)``: the model's pieces as convert_hf_to_gguf.py reads them; the chat markers
    are control tokens (as Gemma's and Phi-3's files mark them)."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(spm_model(vocab_size, markers))
    types = [3 if p.piece in SPM_SPECIALS else p.type for p in proto.pieces]
    return [p.piece for p in proto.pieces], [p.score for p in proto.pieces], types


@functools.lru_cache(maxsize=None)
def phi_pieces(total: int = 3072) -> tuple[list[str], list[float], list[int]]:
    """``(tokens, scores, types)`` in Phi-3.5's layout, ``total`` ids (published: 32,064): SentencePiece pieces
    (3,000, or 20,000 for a full-size vocabulary: this corpus has no more) and unused ones up to ``total - 64``
    (32,000), :data:`PHI_ADDED` as control tokens, then ``[PAD{i}]`` up to ``total`` (unused, score -1000,
    as convert_hf_to_gguf.py pads a SentencePiece vocabulary to the embedding's rows)."""
    base = total - 64
    tokens, scores, types = spm_pieces(3000 if base <= 3008 else 20000, markers=False)
    assert len(tokens) <= base, (len(tokens), total)
    fill = base - len(tokens)
    tokens = tokens + [f"[UNUSED{i}]" for i in range(fill)] + PHI_ADDED
    scores = scores + [-1000.0] * fill + [0.0] * len(PHI_ADDED)
    types = types + [5] * fill + [3] * len(PHI_ADDED)
    pad = total - len(tokens)
    return tokens + [f"[PAD{i}]" for i in range(1, pad + 1)], scores + [-1000.0] * pad, types + [5] * pad


def phi_files(folder: Path, total: int = 3072, name: str = "Phi-3.5-mini") -> tuple[Path, Path]:
    """``(GGUF file, tokenizer.json)`` of :func:`phi_pieces`, the GGUF named ``name`` (``general.name``) and the
    ``tokenizer.json`` laid out as Phi-3.5's (Llama 2's normalizer, its added tokens with ``rstrip``; the padding
    is in neither the vocabulary nor the added tokens there, it is embedding rows only)."""
    folder.mkdir(parents=True, exist_ok=True)
    tokens, scores, types = phi_pieces(total)
    path = write_gguf(folder / "phi.gguf", "llama", tokens, types, token_scores=scores, name=name,
                      bos_token_id=1, eos_token_id=tokens.index("<|endoftext|>"), unk_token_id=0,
                      eot_token_id=tokens.index("<|end|>"), add_bos_token=False, add_space_prefix=True)
    hf = folder / "tokenizer.json"
    hf.write_text(phi_tokenizer_json(total), encoding="utf-8")
    return path, hf


def phi_tokenizer_json(total: int = 3072) -> str:
    """Phi-3.5's ``tokenizer.json`` layout of :func:`phi_pieces` (its padding is embedding rows only)."""
    tokens, scores, types = phi_pieces(total)
    n = tokens.index(PHI_ADDED[-1]) + 1
    return spm_tokenizer_json(tokens[:n], scores[:n], types[:n], True, bos=False, rstrip=True)


def spm_files(folder: Path, add_space_prefix: bool) -> tuple[Path, Path]:
    """``(GGUF file, tokenizer.json)``: Llama 2 / Phi-3's kind with ``add_space_prefix``, Gemma's without."""
    folder.mkdir(parents=True, exist_ok=True)
    tokens, scores, types = spm_pieces()
    path = write_gguf(folder / "spm.gguf", "llama", tokens, types, token_scores=scores, bos_token_id=1,
                      eos_token_id=2, unk_token_id=0, add_bos_token=True, add_space_prefix=add_space_prefix)
    hf = folder / "tokenizer.json"
    hf.write_text(spm_tokenizer_json(tokens, scores, types, add_space_prefix), encoding="utf-8")
    return path, hf


def spm_tokenizer_json(tokens: list[str], scores: list[float], types: list[int], add_space_prefix: bool,
                       bos: bool = True, rstrip: bool = False) -> str:
    """The ``tokenizer.json`` text transformers writes for such a vocabulary; ``bos``: ``<s>`` before each text;
    ``rstrip``: the control tokens strip the whitespace after them, but :data:`PHI_NO_RSTRIP` (Phi-3's)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers.tokenization_utils_base import generate_merges

    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab, generate_merges(vocab, dict(zip(tokens, scores))), unk_token="<unk>",
                               fuse_unk=True, byte_fallback=True))
    if add_space_prefix:                         # Llama 2's and Phi-3.5's tokenizer.json
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    else:                                        # Gemma's
        tok.normalizer = normalizers.Replace(" ", "▁")
        tok.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
                                    + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else []))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False, rstrip=rstrip and t not in PHI_NO_RSTRIP)
                            for t, k in zip(tokens, types) if k == 3])
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s>:0 $A:0", special_tokens=[("<s>", 1)])
    return tok.to_str()
