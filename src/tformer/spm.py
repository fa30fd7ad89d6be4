"""SentencePiece-style vocabularies (GGUF ``tokenizer.ggml.model = llama``: Llama 2, Gemma, Phi-3) as a
``tokenizers`` object, tokenizing as llama.cpp's ``llm_tokenizer_spm`` does (llama.cpp/src/llama-vocab.cpp).

What llama.cpp does with such a vocabulary (tokens, a score per token, token types):

- text: every space becomes ``▁`` (U+2581); with ``add_space_prefix`` one ``▁`` goes in front of the
  text, and again after each special token (control or user-defined) matched in it;
- encode: start from the UTF-8 characters, and repeatedly join the adjacent pair whose join is a
  token with the highest score (equal scores: the leftmost pair); a character that is no token is
  written as its UTF-8 bytes, each the byte token ``<0xNN>`` (byte fallback);
- decode: ``▁`` back to a space, runs of byte tokens back to their bytes (as UTF-8), and with
  ``add_space_prefix`` the first space of the text dropped;
- Phi-3's files (by their ``general.name``): the whitespace right after a special token is dropped
  (:func:`~tformer.tokenizers.llama_cpp_rstrip`), before the prefix ``▁`` goes in front of what follows.

A BPE whose merge list ranks each pair ``(a, b)`` by the score of the token ``a + b`` makes the same
choices (a merge is a join; the best-ranked pair present is the best-scored join present), so the
vocabulary becomes ``tokenizers``' BPE with byte fallback, a normalizer for the ``▁`` and the prefix,
and the decoder Replace / ByteFallback / Fuse / Strip: what transformers writes in the
``tokenizer.json`` of Llama 2 and Phi-3 (its "legacy" normalizer) and, without the prefix, of Gemma.
One difference remains: two different pairs joining to the same token rank one after the other here,
where llama.cpp takes the leftmost; it changes ids only where both occur in one word and the join
then blocks a better one, which the equality tests on varied text have not met.
"""

from __future__ import annotations

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6     # llama.cpp's llama_token_type
SPACE = "\u2581"                                                             # SentencePiece's visible space


def merges_from_scores(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Every split ``(a, b)`` of a token into two tokens, best join first (score descending, then id).

    A token of n characters has n - 1 splits; only those whose halves are both tokens can be joined.
    Byte tokens (``<0xNN>``) are never joined (llama.cpp writes them only for characters no token has)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    byte = {i for i, k in enumerate(types) if k == BYTE}
    merges = []
    for i in sorted(range(len(tokens)), key=lambda i: (-scores[i], i)):     # the tokens, best first
        t = tokens[i]
        if i in byte or len(t) < 2:
            continue
        for k in range(1, len(t)):
            a, b = vocab.get(t[:k]), vocab.get(t[k:])
            if a is not None and b is not None and a not in byte and b not in byte:
                merges.append((t[:k], t[k:]))
    return merges


def gguf_spm_tokenizer(tokens: list[str], scores: list[float] | None, token_types: list[int] | None, *,
                       add_space_prefix: bool = True, bos_id: int | None = None, eos_id: int | None = None,
                       unk_id: int | None = None, add_bos: bool = True, add_eos: bool = False,
                       name: str | None = None):
    """A SentencePiece-style vocabulary as a GGUF file stores it, as an
    :class:`~tformer.tokenizers.HFTokenizer` that tokenizes as llama.cpp does (see the module docstring).

    Args:
        tokens: ``tokenizer.ggml.tokens`` in id order (``▁`` for a space, ``<0xNN>`` for byte tokens).
        scores: ``tokenizer.ggml.scores``, one per token: the higher, the earlier its pieces are joined.
        token_types: ``tokenizer.ggml.token_type`` (:data:`NORMAL` ... :data:`BYTE`); control tokens become
            special tokens (matched whole, left out of decoded text), user-defined ones added tokens.
        add_space_prefix: ``tokenizer.ggml.add_space_prefix`` (Llama 2, Phi-3: yes; Gemma: no).
        bos_id, eos_id, unk_id, add_bos, add_eos: the special ids, and which are put around every
            encoded text (llama.cpp adds BOS to such a vocabulary unless the file says not to).
        name: the file's ``general.name``, which decides the special tokens that take the whitespace after
            them away (Phi-3's, :func:`~tformer.tokenizers.llama_cpp_rstrip`).
    Raises:
        CheckpointError: tokens, scores or types missing or not one per token, a token twice, or a
            special id outside the vocabulary, naming the GGUF key.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers

    from tformer.tokenizers import checked_gguf_tokens, gguf_refusal, gguf_special_tokens

    vocab, types = checked_gguf_tokens(tokens, token_types, {"bos_token_id": bos_id, "eos_token_id": eos_id,
                                                             "unknown_token_id": unk_id})
    n = len(tokens)
    if not isinstance(scores, list) or len(scores) != n or not all(isinstance(s, (int, float)) for s in scores):
        raise gguf_refusal("scores", f"must hold one number per token ({n}) for a SentencePiece vocabulary, which "
                           f"joins pieces by score")
    if unk_id is None:
        unk_id = next((i for i, k in enumerate(types) if k == UNKNOWN), None)

    model = models.BPE(vocab, merges_from_scores(tokens, [float(s) for s in scores], types),
                       unk_token=None if unk_id is None else tokens[unk_id], fuse_unk=True, byte_fallback=True)
    tok = Tokenizer(model)
    # ▁ for every space, and one in front of the text and of each piece after a special token (the
    # normalizer runs on each piece between added tokens), as llama.cpp's is_prev_special does
    spaces = [normalizers.Replace(" ", SPACE)]
    tok.normalizer = normalizers.Sequence(([normalizers.Prepend(SPACE)] if add_space_prefix else []) + spaces)
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
                                    + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else []))
    return gguf_special_tokens(tok, tokens, types, bos_id, add_bos, eos_id, add_eos, name)
