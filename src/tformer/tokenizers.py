"""Tokenizers: text <-> token ids. Each one saves itself as ``tokenizer.json`` beside a checkpoint.

Interface shared by every tokenizer: ``encode(str) -> list[int]``, ``decode(list[int]) -> str``,
``vocab_size``, ``save(path)``, ``to_dict()``; :func:`load_tokenizer` reads any of them back.

Invalid UTF-8: corpus files are decoded with ``errors="replace"`` (each bad byte becomes U+FFFD,
see :mod:`tformer.training.data`), and :func:`clean_text` does the same for strings that carry
undecodable bytes as lone surrogates (Python's ``surrogateescape``, e.g. command-line arguments).
So no input byte can crash a run.

Round trips: ``decode(encode(text)) == text`` holds for every clean string with tformer's own vocabularies
(``char``: every string of the vocabulary's characters; ``bpe``: every clean string; neither has special
tokens). A converted model's or a GGUF's vocabulary (:class:`HFTokenizer`) has special tokens, which
``encode`` recognises in the text (``<|im_start|>`` becomes one control token) and ``decode`` leaves out:
there ``decode(encode(text)) == text`` holds for clean text that contains no special-token string and that the
vocabulary's normalizer leaves as it is (byte-level vocabularies, SmolLM2's, Llama 3's, Qwen's, have none).
For such text with special-token strings in it, ``decode(encode(text, parse_special=False)) == text`` (the
strings encoded as the characters they are) and ``decode(encode(text, add_special_tokens=False),
skip_special_tokens=False) == text`` (encoded as the tokens they are, and kept on decode).
"""

from __future__ import annotations

import json
import os
import re
from itertools import compress
from pathlib import Path
from typing import Iterable

import numpy as np

from tformer.checkpoint import resolve_checkpoint
from tformer.io import atomic_write_json
from tformer.errors import CheckpointError, ConfigError, InputError

TOKENIZER = "tokenizer.json"
KINDS = ("char", "bpe")


def clean_text(text: str) -> str:
    """Replace lone surrogates (undecodable bytes smuggled into a ``str``) by U+FFFD; else unchanged."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        try:
            raw = text.encode("utf-8", "surrogateescape")   # back to the original bytes
        except UnicodeEncodeError:
            raw = text.encode("utf-8", "surrogatepass")
        return raw.decode("utf-8", "replace")


class CharTokenizer:
    """One id per distinct character of the training text (nanoGPT's shakespeare_char)."""

    kind = "char"

    def __init__(self, chars: list[str]):
        self.chars = list(chars)
        self.index = {c: i for i, c in enumerate(self.chars)}
        # Sorted code points -> ids, for vectorised encoding of long texts.
        order = sorted(range(len(self.chars)), key=lambda i: ord(self.chars[i]))
        self._points = np.array([ord(self.chars[i]) for i in order], dtype=np.int64)
        self._ids = np.array(order, dtype=np.int64)

    @classmethod
    def train(cls, text: str | Iterable[str]) -> "CharTokenizer":
        """Vocabulary = the sorted distinct characters of ``text`` (a string or an iterable of chunks)."""
        chunks = [text] if isinstance(text, str) else text
        chars: set[str] = set()
        for chunk in chunks:
            chars.update(clean_text(chunk))
        if not chars:
            raise InputError("cannot build a character vocabulary from empty text; give a non-empty corpus.")
        return cls(sorted(chars))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()

    def encode_array(self, text: str) -> np.ndarray:
        """``encode`` as an int64 array, vectorised (a few MB per second per core is not enough)."""
        text = clean_text(text)
        points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
        pos = np.searchsorted(self._points, points).clip(max=max(len(self._points) - 1, 0))
        bad = self._points[pos] != points if len(points) else np.zeros(0, bool)
        if bad.any():
            unknown = sorted({chr(p) for p in points[bad]})
            raise InputError(f"characters {''.join(unknown[:10])!r} are not in this character vocabulary "
                             f"({self.vocab_size} characters); use only characters seen in training.")
        return self._ids[pos]

    def decode(self, ids: Iterable[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "chars": self.chars}

    def save(self, path: str | os.PathLike) -> None:
        atomic_write_json(path, self.to_dict())


class BPETokenizer:
    """Byte-level BPE (GPT-2 style) trained on the corpus with Hugging Face ``tokenizers``.

    Every byte has a token, so any text encodes; merges learned from the corpus shorten it.
    """

    kind = "bpe"

    def __init__(self, tokenizer):  # a tokenizers.Tokenizer
        self.tok = tokenizer

    @classmethod
    def train(cls, text: str | Iterable[str], vocab_size: int = 1024) -> "BPETokenizer":
        """Learn ``vocab_size - 256`` merges on top of the 256 byte tokens.

        Raises:
            ConfigError: ``vocab_size`` below 256 (each byte needs a token).
        """
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        if vocab_size < 256:
            raise ConfigError(f"bpe_vocab_size={vocab_size} is too small: byte-level BPE needs at least 256 "
                             f"(one token per byte); use e.g. --set bpe_vocab_size=1024.")
        chunks = [text] if isinstance(text, str) else text
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, special_tokens=[],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator((clean_text(c) for c in chunks), trainer)
        return cls(tok)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True, parse_special: bool = True) -> list[int]:
        """Ids of ``text``; ``add_special_tokens=False`` leaves out what the post-processor adds (a BOS),
        as a rendered chat template, which writes its own, needs. ``parse_special=False``: special-token
        strings in ``text`` (``<|im_start|>``) are encoded as the characters they are, not as the token."""
        tok = self.tok if parse_special else self._literal()
        return tok.encode(clean_text(text), add_special_tokens=add_special_tokens).ids

    def _literal(self):
        """A copy of the tokenizer that does not parse special-token strings (made once)."""
        literal = getattr(self, "_literal_tok", None)
        if literal is None:
            from tokenizers import Tokenizer

            literal = Tokenizer.from_str(self.tok.to_str())
            literal.encode_special_tokens = True
            self._literal_tok = literal
        return literal

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.int64)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids``; special (control) tokens are left out unless ``skip_special_tokens=False``."""
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "tokenizer": json.loads(self.tok.to_str())}

    def save(self, path: str | os.PathLike) -> None:
        atomic_write_json(path, self.to_dict())


class HFTokenizer(BPETokenizer):
    """Any HuggingFace ``tokenizers`` file (BPE, WordPiece, Unigram), used as it is: the
    ``tokenizer.json`` of a converted HF model."""

    kind = "tokenizers"

    def save(self, path: str | os.PathLike) -> None:
        """The ``tokenizers`` library's own ``tokenizer.json`` (what transformers reads too)."""
        from tformer.io import atomic_write
        atomic_write(path, lambda tmp: self.tok.save(tmp))


# ------------------------------------------------------------------ GGUF vocabularies (llama.cpp)
# The pre-tokenizer of a byte-level BPE vocabulary, by the name llama.cpp writes in tokenizer.ggml.pre:
# regular expressions applied in turn, each splitting the pieces of the one before (matches and the
# text between them become pieces), as llama.cpp's llm_tokenizer_bpe does (llama.cpp/src/llama-vocab.cpp).
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
LLAMA3_SPLIT = CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2_SPLIT = CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
GGUF_PRE_SPLITS = {
    "gpt2": [GPT2_SPLIT], "gpt-2": [GPT2_SPLIT],
    "smollm": [r"\p{N}", GPT2_SPLIT],                         # digits one by one, then GPT-2's split
    "llama-bpe": [LLAMA3_SPLIT], "llama3": [LLAMA3_SPLIT], "llama-v3": [LLAMA3_SPLIT],
    "qwen2": [QWEN2_SPLIT],
    "default": [r"[\p{P}\$\+<=>\^~\|]+", GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]"],
}
# The same splits as the families' tokenizer.json files write them (a Split pre-tokenizer before ByteLevel,
# the contractions case-insensitive by a flag), by llama.cpp's name for them: how a tokenizer.json is named
# when it is written into a GGUF file
HF_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
HF_PRE_SPLITS = {name: HF_CONTRACTIONS + GGUF_PRE_SPLITS[name][0].removeprefix(CONTRACTIONS)
                 for name in ("llama-bpe", "qwen2")}
IGNORE_MERGES = ("llama-bpe", "llama3", "llama-v3")   # a piece that is a whole token is taken as it is
UNKNOWN, CONTROL, USER_DEFINED, UNUSED = 2, 3, 4, 5               # llama.cpp token types (llama_token_type)


def gguf_refusal(key: str, why: str) -> CheckpointError:
    """The refusal of a damaged ``tokenizer.ggml.{key}``, in one sentence."""
    return CheckpointError(f"GGUF metadata tokenizer.ggml.{key} {why}; the file is damaged.")


def checked_gguf_tokens(tokens, token_types, special_ids: dict[str, int | None]) -> tuple[dict[str, int], list[int]]:
    """``(vocab, token types)`` of a GGUF vocabulary of either kind (types ``[]`` where the file has none),
    refusing, naming the GGUF key, no tokens, a token twice, types not one per token, or a special id
    (``special_ids``: ``"bos_token_id"`` -> id or None) outside the vocabulary."""
    if not isinstance(tokens, list) or not tokens or set(map(type, tokens)) != {str}:
        raise gguf_refusal("tokens", "is missing or is not a non-empty array of strings, so the file's token ids "
                           "mean nothing")
    vocab = dict(zip(tokens, range(len(tokens))))
    if len(vocab) != len(tokens):                           # find the first repeat only when there is one
        seen: dict[str, int] = {}
        for i, t in enumerate(tokens):
            if t in seen:
                raise gguf_refusal("tokens", f"lists {t!r} twice (ids {seen[t]} and {i}), so one of the ids could "
                                   f"never be produced")
            seen[t] = i
    types = list(token_types) if token_types is not None else []
    if token_types is not None and (len(types) != len(tokens) or not set(map(type, types)) <= {int}):   # no bool
        raise gguf_refusal("token_type", f"must hold one integer per token ({len(tokens)}); it holds {len(types)} "
                           f"items")
    for key, i in special_ids.items():
        if i is not None and (not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(tokens)):
            raise gguf_refusal(key, f"is {i!r}, which is not the id of one of the {len(tokens)} tokens")
    return vocab, types


def _merge_fault(merges: list[str], vocab: dict[str, int]) -> str | None:
    """Why the first bad entry of ``tokenizer.ggml.merges`` is bad (not two tokens separated by a space, or
    a piece that is not a token), or None when every merge is two tokens making a token."""
    for n, m in enumerate(merges):
        left, space, right = m.partition(" ")
        if not space or not left or not right:
            return f"entry {n} ({m!r}) is not two tokens separated by a space"
        for piece in (left, right, left + right):
            if piece not in vocab:
                return f"entry {n} ({m!r}) needs {piece!r}, which is not one of the tokens"
    return None


def gguf_bpe_tokenizer(tokens: list[str], merges: list[str], token_types: list[int] | None, pre: str, *,
                       bos_id: int | None = None, eos_id: int | None = None, add_bos: bool = False,
                       add_eos: bool = False, name: str | None = None) -> HFTokenizer:
    """A byte-level BPE vocabulary as a GGUF file stores it, as a ``tokenizers`` object.

    Args:
        tokens: ``tokenizer.ggml.tokens``, id order, in GPT-2's byte alphabet (a space is ``Ġ``).
        merges: ``tokenizer.ggml.merges``, ``"left right"`` strings, best first.
        token_types: ``tokenizer.ggml.token_type``; control tokens (3) become special tokens that are
            matched whole and left out of decoded text, user-defined ones (4) plain added tokens.
        pre: ``tokenizer.ggml.pre``, one of :data:`GGUF_PRE_SPLITS`.
        bos_id, add_bos, eos_id, add_eos: the token put before / after every encoded text, if asked.
        name: the file's ``general.name``, which decides the tokens that take the whitespace after them away
            (:func:`llama_cpp_rstrip`).
    Raises:
        CheckpointError: an unknown ``pre``, or a vocabulary the ``tokenizers`` library would crash on or
            silently misread (no tokens, a token twice, a merge of unknown tokens or without a space,
            ``token_types`` not one per token, a bos / eos id outside the vocabulary), naming the GGUF key.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    if pre not in GGUF_PRE_SPLITS:
        raise CheckpointError(f"GGUF metadata tokenizer.ggml.pre={pre!r} names a pre-tokenizer tformer does not "
                              f"know (it knows {', '.join(GGUF_PRE_SPLITS)}); its splitting rules decide the ids.")
    vocab, types = checked_gguf_tokens(tokens, token_types, {"bos_token_id": bos_id, "eos_token_id": eos_id})
    if not isinstance(merges, list) or not set(map(type, merges)) <= {str}:
        raise gguf_refusal("merges", "is not an array of strings")
    # that every merge is two tokens making a token is checked by the BPE model as it is built
    # (:func:`_merge_fault` names the entry when it refuses)
    pairs = [m.partition(" ")[::2] for m in merges]
    try:
        tok = Tokenizer(models.BPE(vocab, pairs, ignore_merges=pre in IGNORE_MERGES))
    except BaseException as e:  # noqa: BLE001  the Rust library panics (a BaseException) on what it cannot build
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        fault = _merge_fault(merges, vocab)
        if fault is not None:
            raise gguf_refusal("merges", fault) from None
        raise CheckpointError(f"the GGUF vocabulary (tokenizer.ggml.tokens / tokenizer.ggml.merges) cannot be "
                              f"built: {str(e).splitlines()[0] if str(e) else type(e).__name__}; the file is "
                              f"damaged.") from None
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in GGUF_PRE_SPLITS[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return gguf_special_tokens(tok, tokens, types, bos_id, add_bos, eos_id, add_eos, name)


def gguf_special_tokens(tok, tokens: list[str], types: list[int], bos_id: int | None, add_bos: bool,
                        eos_id: int | None, add_eos: bool, name: str | None = None) -> HFTokenizer:
    """A GGUF vocabulary's ``tokenizers`` object finished: its control tokens (type 3) as special tokens (matched
    whole, left out of decoded text), its user-defined ones (4) as plain added tokens (matched whole, as
    llama.cpp always does), those that the file's ``general.name`` makes take the whitespace after them away
    (:func:`llama_cpp_rstrip`), and BOS before / EOS after every encoded text, as asked. ``tokens`` and
    ``types`` are :func:`checked_gguf_tokens`' (the builders check them first)."""
    from tokenizers import AddedToken, processors

    ids, rstrip = range(len(types)), llama_cpp_rstrip(name, tokens, types)
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False, rstrip=i in rstrip)
                            for i in compress(ids, map(CONTROL.__eq__, types))])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False, rstrip=i in rstrip)
                    for i in compress(ids, map(USER_DEFINED.__eq__, types))])
    single = ([f"{tokens[bos_id]}:0"] if add_bos and bos_id is not None else []) + ["$A:0"] + \
        ([f"{tokens[eos_id]}:0"] if add_eos and eos_id is not None else [])
    specials = [(tokens[i], i) for i, flag in ((bos_id, add_bos), (eos_id, add_eos)) if flag and i is not None]
    tok.post_processor = processors.TemplateProcessing(single=" ".join(single), special_tokens=specials)
    return HFTokenizer(tok)


PHI3_NAMES = ("phi-3", "phi3")                      # in general.name, any case: llama.cpp's test for Phi-3
PHI3_KEEP_SPACE = ("<unk>", "<s>", "<|endoftext|>")


def llama_cpp_rstrip(name: str | None, tokens: list[str], types: list[int]) -> frozenset[int]:
    """The ids of the tokens after which llama.cpp drops the whitespace (``LLAMA_TOKEN_ATTR_RSTRIP``) when it
    matches them in text. It sets that by the file's ``general.name``: in a Phi-3 file (the name, lower-cased,
    holds ``phi-3`` or ``phi3``) every control, user-defined and unknown token, and ``</s>``, but ``<unk>``,
    ``<s>`` and ``<|endoftext|>``, as Phi-3's ``tokenizer.json`` sets ``rstrip``; so ``<|user|>\nhi``
    tokenizes as ``<|user|>hi``. Elsewhere none. (It strips ASCII whitespace, the ``tokenizers`` library any
    Unicode whitespace: they differ only on such a character right after a marker.)"""
    if not isinstance(name, str) or not any(s in name.lower() for s in PHI3_NAMES):
        return frozenset()
    ids = {i for i, k in enumerate(types) if k in (CONTROL, USER_DEFINED, UNKNOWN)}
    ids |= {i for i, t in enumerate(tokens) if t == "</s>"}
    return frozenset(i for i in ids if tokens[i] not in PHI3_KEEP_SPACE)


# ------------------------------------------------------------------ chat templates
RENDER_SECONDS = 5.0             # a render that takes longer is stopped (a template in a loop)
RENDER_CHARS = 4 * 2**20         # characters a rendered conversation may have (far beyond any context)
RENDER_MEMORY = 1 << 29          # bytes of address space the renderer's process may use
RENDER_WORKERS = 4               # renders at once (the server's concurrent chat requests)
RENDER_START_SECONDS = 60.0      # for a renderer process to start (not counted in a render's deadline)


class _Worker:
    """One renderer process (:mod:`tformer.template_worker`): a request line in, an answer line out."""

    def __init__(self):
        import subprocess
        import sys

        script = str(Path(__file__).with_name("template_worker.py"))
        # -I: neither the script's folder nor the working directory can shadow a module; the parent's
        # import path is passed instead, so jinja2 is the one this process imports
        self.proc = subprocess.Popen([sys.executable, "-I", script, str(RENDER_MEMORY),
                                      json.dumps([p for p in sys.path if p])], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, bufsize=0)
        self.buffer, self.ready = b"", False

    def ask(self, request: dict, seconds: float) -> dict | None:
        """The answer; ``None`` when none came within ``seconds`` (the process is then killed), ``{"died": ...}``
        when the process ended without one. Starting the process (its ``ready`` line: Python and jinja2
        imported) is not counted in ``seconds``: a busy machine may take a while."""
        if not self.ready:
            started = self.line(RENDER_START_SECONDS)
            if not isinstance(started, dict) or not started.get("ready"):
                return {"died": "it did not start"} if started is None else started
            self.ready = True
        try:
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        except OSError:
            self.close()
            return {"died": "it had ended"}
        return self.line(seconds)

    def line(self, seconds: float) -> dict | None:
        """The next line the process writes, as JSON; ``None`` past ``seconds`` (then it is killed),
        ``{"died": ...}`` when it ends first."""
        import selectors
        import time

        deadline = time.monotonic() + seconds
        fd = self.proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:              # not select(): a server's fds pass 1024
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self.buffer:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    self.close()
                    return None
                chunk = os.read(fd, 1 << 16)
                if not chunk:                                    # it died (out of memory, killed)
                    self.close()
                    return {"died": f"it ended with status {self.proc.returncode}"}
                self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return json.loads(line)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


class _Renderers:
    """Idle renderer processes, at most :data:`RENDER_WORKERS` busy at once; started on first use."""

    def __init__(self):
        import atexit
        import threading

        self.lock, self.idle, self.slots = threading.Lock(), [], threading.BoundedSemaphore(RENDER_WORKERS)
        atexit.register(self.close)

    def close(self) -> None:
        """End the idle processes (at exit; a busy one ends when its pipe closes)."""
        with self.lock:
            idle, self.idle = self.idle, []
        for worker in idle:
            worker.close()

    def ask(self, request: dict, seconds: float) -> dict | None:
        with self.slots:
            with self.lock:
                worker = self.idle.pop() if self.idle else None
            reused = worker is not None and worker.alive
            if not reused:
                worker = _Worker()
            try:
                answer = worker.ask(request, seconds)
                if reused and answer is not None and "died" in answer:   # an idle one that had ended: once more,
                    worker = _Worker()                                   # on a fresh one (never twice for a
                    answer = worker.ask(request, seconds)                # template that kills its own worker)
            except BaseException:                                  # Ctrl-C while waiting: its render is abandoned
                worker.close()
                raise
            if worker.alive:
                with self.lock:
                    self.idle.append(worker)
            return answer


_RENDERERS = _Renderers()


class ChatTemplate:
    """A model's chat template (Jinja2, as HF ``tokenizer_config.json`` and GGUF ``tokenizer.chat_template``
    store it), rendered the way transformers' ``apply_chat_template`` renders it: a sandboxed
    environment (``ImmutableSandboxedEnvironment``: a template cannot reach Python attributes or
    mutate its inputs), ``trim_blocks`` and ``lstrip_blocks``, the loop-controls extension, ``tojson``
    without ASCII escaping or key sorting, ``raise_exception``, ``strftime_now``, and the variables
    ``messages``, ``add_generation_prompt`` and the special tokens by name. The one renderer of
    ``chat``, ``serve`` and ``finetune``.

    A template is a program from a model file, so it runs bounded: in a separate process
    (:mod:`tformer.template_worker`) with ``seconds`` to finish (then the process is killed), at most
    :data:`RENDER_CHARS` characters of output and :data:`RENDER_MEMORY` bytes of memory. Whatever a
    template does wrong (loops for ever, divides by zero, adds a string to a number, recurses, refuses
    with ``raise_exception``) is an :class:`InputError` in one sentence. Waiting for the process
    releases the GIL, so a server renders in a worker thread without stalling its event loop.

    Args:
        source: the Jinja2 text.
        special: ``bos_token``, ``eos_token``, ... as strings, passed to the template.
        seconds: the deadline of one render.
    """

    def __init__(self, source: str, seconds: float = RENDER_SECONDS, **special: str):
        from jinja2 import Environment, nodes
        from jinja2.exceptions import TemplateError
        from jinja2.ext import loopcontrols

        try:                       # parsed here, so a broken template is refused when the model is opened
            parsed = Environment(extensions=[loopcontrols]).parse(source)
        except TemplateError as e:
            raise CheckpointError(f"the chat template does not parse ({e}); fix chat_template in "
                                  f"tokenizer_config.json.") from None
        except RecursionError:
            raise CheckpointError("the chat template is nested too deeply to parse; fix chat_template in "
                                  "tokenizer_config.json.") from None
        self.source, self.special, self.seconds = source, special, seconds
        # whether the template reads ``tools`` (Qwen3's, Llama 3.x's do; ChatML's, Gemma's do not): its syntax
        # tree only (jinja2.meta would compile it, folding constants here, outside the bounded renderer)
        self.takes_tools = any(n.name == "tools" and n.ctx == "load" for n in parsed.find_all(nodes.Name))

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
               **variables) -> str:
        """The conversation as the model's prompt text; with ``add_generation_prompt`` it ends where
        the assistant's next answer begins.

        As transformers' ``apply_chat_template``: a message is a dict with a ``role`` and its ``content``
        (a string, or a list of parts such as ``{"type": "text", "text": ...}``; it may be left out of an
        assistant's ``tool_calls`` message), any other keys as they are; keys whose value is ``None`` are
        dropped; a ``reasoning_content`` / ``thinking`` / ``reasoning`` is passed under all three names.
        ``tools``: JSON schemas of the functions the model may call (the template's ``tools``, ``None``
        when not given). ``variables``: the template's own options (Qwen3's ``enable_thinking``, Llama 3's
        ``date_string``, ...), which override the special tokens by name."""
        messages = [normalize_message(m) for m in messages]
        if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
            raise InputError(f"tools must be a list of JSON schemas (dicts); got {tools!r:.200}.")
        try:
            json.dumps([messages, tools, variables])
        except (TypeError, ValueError) as e:
            raise InputError(f"the chat messages, tools and template options must be JSON data ({e}).") from None
        request = {"source": self.source, "special": {**self.special, **variables}, "messages": messages,
                   "tools": tools, "add_generation_prompt": bool(add_generation_prompt), "max_chars": RENDER_CHARS}
        answer = _RENDERERS.ask(request, self.seconds)
        if answer is None:
            raise InputError(f"the chat template did not finish rendering these messages within {self.seconds:g} s "
                             f"and was stopped; it runs too long on them, so shorten the messages or fix the template.")
        if "died" in answer:
            raise InputError(f"the chat template's renderer process ended while rendering these messages "
                             f"({answer['died']}: out of its {RENDER_MEMORY >> 20} MiB, or killed); shorten the "
                             f"messages or fix the template.")
        if "refused" in answer:
            raise InputError(f"the chat template refuses these messages: {answer['refused']}")
        if "error" in answer:
            error = answer["error"]
            if error.startswith("TemplateOutputTooLong"):
                raise InputError(f"the chat template wrote more than {RENDER_CHARS} characters for these messages "
                                 f"and was stopped; shorten the messages or fix the template.")
            raise InputError(f"the chat template cannot render these messages ({error}); fix the template or "
                             f"change the messages.")
        return answer["text"]

    def _specials(self, tokenizer):
        """The tokenizer's special-token strings and a pattern matching any of them (longest first), made
        once per tokenizer, not per request."""
        if getattr(self, "_specials_of", None) is not tokenizer:
            specials = special_strings(tokenizer)
            pattern = re.compile("|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True))) \
                if specials else None
            self._specials_of, self._specials_made = tokenizer, (specials, pattern)
        return self._specials_made

    def encode(self, tokenizer, messages: list[dict], add_generation_prompt: bool = True,
               parse_special: bool = False, tools: list[dict] | None = None, **variables) -> list[int]:
        """Token ids of the rendered conversation (nothing added: the template writes any BOS itself).

        The template's own markers (``<|im_start|>``, ...) become their special tokens; the same strings
        typed inside a message's content stay text (encoded as the characters they are), so a user
        cannot forge turn boundaries or a system message. ``parse_special=True``: the old behaviour,
        special-token strings in the content become special tokens too (as transformers does)."""
        specials, pattern = self._specials(tokenizer)

        def render(messages):
            return self.render(messages, add_generation_prompt, tools, **variables)
        if parse_special or not specials:
            return tokenizer.encode(render(messages), add_special_tokens=False)
        hidden: dict[str, str] = {}

        def hide(match) -> str:                # a typed special string -> a private-use placeholder
            key = f"\ue000{len(hidden)}\ue001"
            hidden[key] = match.group(0)
            return key
        def hidden_in(content):                # a string, or the text of each part of a list
            if isinstance(content, str):
                return pattern.sub(hide, content.replace("\ue000", "\ue000\ue002"))
            if isinstance(content, list):
                return [{**p, "text": hidden_in(p["text"])} if isinstance(p, dict) and isinstance(p.get("text"), str)
                        else p for p in content]
            return content
        safe = [{**m, "content": hidden_in(m.get("content"))} if isinstance(m, dict) else m for m in messages]
        if not hidden:
            return tokenizer.encode(render(messages), add_special_tokens=False)
        text = render(safe)
        restore = _RESTORE

        def unhide(piece: str) -> str:
            return restore.sub(lambda m: hidden[m.group(0)] if m.group(1) is not None else "\ue000", piece)
        ids, at = [], 0
        for match in pattern.finditer(text):   # the template's own markers: split there, as tokenizers does
            if match.start() > at:
                ids += tokenizer.encode(unhide(text[at:match.start()]), add_special_tokens=False, parse_special=False)
            ids.append(specials[match.group(0)])
            at = match.end()
        if at < len(text):
            ids += tokenizer.encode(unhide(text[at:]), add_special_tokens=False, parse_special=False)
        return ids


REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")     # names templates read a message's reasoning by


def normalize_message(m) -> dict:
    """A chat message as transformers hands it to a template: checked, ``None`` values dropped, its reasoning
    under each of :data:`REASONING_FIELDS` (the first is the standard one; gpt-oss's templates read ``thinking``)."""
    content = m.get("content") if isinstance(m, dict) else None
    if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not (
            isinstance(content, (str, list)) or (content is None and m.get("tool_calls"))):
        raise InputError(f"a chat message must be {{'role': str, 'content': str or a list of parts}} (content may be "
                         f"left out beside tool_calls); got {m!r:.200}.")
    out = {k: v for k, v in m.items() if v is not None}
    reasoning = next((out[k] for k in REASONING_FIELDS if k in out), None)
    return out if reasoning is None else {"thinking": reasoning, **out, "reasoning_content": reasoning}


# a placeholder of ChatTemplate.encode (private-use characters around its number), or an escaped \ue000
_RESTORE = re.compile("\ue000(\\d+)\ue001|\ue000\ue002")


def special_strings(tokenizer) -> dict[str, int]:
    """``{text: id}`` of the tokenizer's special (control) tokens: ``{}`` for tformer's own vocabularies."""
    inner = getattr(tokenizer, "tok", None)
    if inner is None or not hasattr(inner, "get_added_tokens_decoder"):
        return {}
    return {t.content: i for i, t in inner.get_added_tokens_decoder().items() if t.special and t.content}


TOKENIZER_CONFIG = "tokenizer_config.json"


CHAT_TEMPLATE_FILE = "chat_template.jinja"


def load_chat_template(folder: str | os.PathLike) -> ChatTemplate | None:
    """The chat template saved with a checkpoint, or ``None``: ``chat_template.jinja`` (where
    transformers 5 writes it) or else ``tokenizer_config.json``'s ``chat_template``."""
    path, jinja = Path(folder) / TOKENIZER_CONFIG, Path(folder) / CHAT_TEMPLATE_FILE
    if not path.is_file() and not jinja.is_file():
        return None
    try:
        conf = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except ValueError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); restore it or convert the model again.") from None
    source = jinja.read_text(encoding="utf-8") if jinja.is_file() else conf.get("chat_template")
    if isinstance(source, list):               # HF allows named templates: take the default one
        source = next((t.get("template") for t in source if t.get("name") == "default"), None)
    if not isinstance(source, str):
        return None
    special = {k: v for k, v in conf.items() if k.endswith("_token") and isinstance(v, str)}
    return ChatTemplate(source, **special)


def train_tokenizer(kind: str, chunks: Iterable[str], vocab_size: int = 1024):
    """Train a tokenizer of ``kind`` (``char`` or ``bpe``) on an iterable of text chunks."""
    if kind == "char":
        return CharTokenizer.train(chunks)
    if kind == "bpe":
        return BPETokenizer.train(chunks, vocab_size)
    raise ConfigError(f"tokenizer={kind!r} is not known; choose one of {', '.join(KINDS)}.")


def tokenizer_from_dict(data: dict):
    """Rebuild a tokenizer from :meth:`to_dict` output, or from a HuggingFace ``tokenizer.json``
    (the ``tokenizers`` library's own file, as ``tformer convert --from-hf`` copies it along)."""
    kind = data.get("kind")
    if kind is None and "model" in data:  # the tokenizers library's own file
        data = {"kind": HFTokenizer.kind, "tokenizer": data}
        kind = HFTokenizer.kind
    if kind == HFTokenizer.kind:
        from tokenizers import Tokenizer
        return HFTokenizer(Tokenizer.from_str(json.dumps(data["tokenizer"])))
    if kind == "char":
        return CharTokenizer(data["chars"])
    if kind == "bpe":
        from tokenizers import Tokenizer
        return BPETokenizer(Tokenizer.from_str(json.dumps(data["tokenizer"])))
    raise CheckpointError(f"unknown tokenizer kind {kind!r}; known: {', '.join(KINDS)}.")


def load_tokenizer(path: str | os.PathLike):
    """Read a tokenizer from ``tokenizer.json`` or from a checkpoint folder that holds one."""
    path = Path(path)
    if path.is_dir():  # a checkpoint folder, or a run folder (its latest checkpoint)
        path = path / TOKENIZER if (path / TOKENIZER).is_file() else resolve_checkpoint(path) / TOKENIZER
    if not path.is_file():
        raise CheckpointError(f"no tokenizer at {path}; pass a checkpoint folder written by `tformer train`.")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return tokenizer_from_dict(data)
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from e
    except Exception as e:  # json / tokenizers errors
        raise CheckpointError(f"cannot read {path}: {e}. The checkpoint is damaged; retrain or restore it.") from e
