"""Opening a model to run it: the one loader behind ``chat``, ``generate``, ``serve``, ``finetune``,
the interpretability report, the real-model claims and the benchmarks.

    opened = open_model("smollm2")                 # the built-in SmolLM2-135M-Instruct (its Q4_1 blocks)
    opened = open_model("model.gguf", dtype="fp32") # any GGUF tformer imports, widened to float32
    opened = open_model("runs/x")                  # a tformer checkpoint or run folder
    opened = open_model("Qwen2.5-0.5B/")           # a HuggingFace folder (config.json + safetensors)
    opened.model, opened.tokenizer, opened.template, opened.stop_ids, opened.defaults
    print(opened.describe())                       # which weights and which path, and why

Everything a command would otherwise decide for itself is decided here, once:

- **weights** (``dtype``): ``auto`` runs a GGUF whose layer matrices are all in one block format tformer
  multiplies as it is (q8_0, q4_0, q4_1) from those blocks, as llama.cpp would; anything else in float32
  (bf16 / fp16 round the weights, so they are asked for, never chosen silently). A named dtype is honoured:
  a GGUF stored in that format keeps its bytes, otherwise the float weights are cast or re-quantised.
- **the path** each step takes: whole decoder layers in one C++ call, or the module path, with the reason
  (:func:`choose_path`); chosen when the model is opened, not retried every token. Only its repacks into
  tiles are left running when the open returns, on a thread of their own that began as soon as the model
  was built (C++ outside the GIL, beside the vocabulary and template); the first prompt or step waits for
  them and raises what they raised (:mod:`tformer.fused.pending`).
- **threads** where none are asked for: torch's count less the cores other processes keep busy while the
  model loads (:class:`tformer.machine.FreeCores`), so a busy neighbour does not make every parallel region
  wait out its time slices. Opening itself runs at one thread, the repacks on their own thread at one too.
- **stop ids**: the file's end-of-sequence ids together with the chat template's end-of-turn token, so a
  model whose ``eos`` is not its end-of-turn stops at the same token in ``chat`` and ``serve``.
- **sampling defaults** a GGUF recommends (``general.sampling.*``), for the commands to use where the
  user named none.

A GGUF opens from the file itself: its tokenizer, chat template and metadata are read from the header and
its blocks are copied once into the model; nothing is written to the cache (``tformer convert
--from-gguf`` writes a float checkpoint when one is wanted).
"""

from __future__ import annotations

import gc
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from tformer.errors import CheckpointError, InputError
from tformer.machine import FreeCores

AUTO = "auto"
# GGUF general.sampling.* key -> the generation option it sets (llama.cpp's names: gguf-py Keys.General)
SAMPLING_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
                 "general.sampling.top_p": "top_p", "general.sampling.min_p": "min_p",
                 "general.sampling.penalty_repeat": "repetition_penalty"}


@dataclass
class OpenedModel:
    """A model ready to generate, with what every front end needs beside it.

    Attributes:
        model: the model, in eval mode, its weights as ``dtype`` says.
        tokenizer: ``encode`` / ``decode``; ``None`` where the source has none.
        template: the chat template (:class:`tformer.tokenizers.ChatTemplate`), or ``None``.
        stop_ids: token ids that end an answer: ``eos`` ∪ the template's end-of-turn.
        defaults: sampling defaults the source recommends (``temperature``, ``top_k``, ``top_p``, ``min_p``,
            ``repetition_penalty``).
        name: what to call it (``smollm2``, the file's stem, the folder's name).
        source: the GGUF file or checkpoint folder read.
        dtype, dtype_reason: the weights as opened, and why.
        path, path_reason: ``"whole-layer"`` or ``"module"``, and why.
        seconds: how long opening took (reading, building, the path chosen; not the tiles still being made).
        kind: ``"gguf"``, ``"checkpoint"`` or ``"hf"``: what ``source`` is.
    """

    model: torch.nn.Module
    tokenizer: object
    template: object
    stop_ids: list[int]
    defaults: dict
    name: str
    source: Path
    dtype: str
    dtype_reason: str
    path: str = "module"
    path_reason: str = ""
    seconds: float = 0.0
    kind: str = "gguf"

    def describe(self) -> str:
        """One line: the weights and the path, each with its reason (``--verbose``, chat's banner)."""
        return (f"{self.name}: weights {self.dtype} ({self.dtype_reason}); {self.path} path ({self.path_reason}); "
                f"{torch.get_num_threads()} threads; opened in {self.seconds:.2f} s")


def resolve_source(spec: str | os.PathLike | None) -> tuple[str, Path, str]:
    """``(name, path, kind)`` for a model spec: a built-in name (default ``smollm2``) or a GGUF file
    (``"gguf"``), a checkpoint / run folder (``"checkpoint"``) or a HuggingFace folder (``"hf"``).

    Raises:
        InputError: a spec that is none of these (one sentence listing what is accepted).
    """
    from tformer.checkpoint import CONFIG, POINTER, resolve_checkpoint
    from tformer.interop.builtin import BUILTIN, DEFAULT_MODEL, builtin_path

    spec = str(spec if spec is not None else DEFAULT_MODEL)
    if spec in BUILTIN:
        return spec, builtin_path(spec), "gguf"
    path = Path(spec)
    if path.is_file():
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise InputError(f"{spec} is a file but not a GGUF model; pass a .gguf file, a checkpoint "
                                 f"folder or one of {', '.join(BUILTIN)}.")
        return path.stem, path, "gguf"
    if not path.exists():
        raise InputError(f"{spec} does not exist: it is neither a built-in model ({', '.join(BUILTIN)}) nor an "
                         f"existing file or folder; pass one of those.")
    if path.is_dir() and (path / "config.json").is_file() and not (path / CONFIG).is_file() \
            and not (path / POINTER).is_file():
        return path.resolve().name, path, "hf"
    return path.resolve().name, resolve_checkpoint(path), "checkpoint"


def auto_dtype(formats: set[str] | None) -> tuple[str, str]:
    """``(dtype, reason)`` for ``--dtype auto``: a GGUF's own block format when every layer matrix is stored
    in one tformer multiplies as it is (``formats``: :func:`tformer.interop.gguf_import.layer_formats`);
    ``"q4_k+q6_k"`` (the formats joined) when they are several or K-quants, each matrix kept in its own;
    float32 otherwise (``formats`` ``None``: a float checkpoint)."""
    from tformer.interop.gguf_import import KEPT
    from tformer.quant.quantize import BLOCK_FORMATS

    if formats is None:
        return "fp32", "auto: a float checkpoint runs in float32; bf16 / fp16 round its weights, ask for them"
    if len(formats) == 1 and formats <= set(BLOCK_FORMATS):
        fmt = next(iter(formats))
        return fmt, f"auto: the file's own {fmt} blocks, multiplied as stored"
    if formats and formats <= set(KEPT.values()):
        return file_formats(formats), f"auto: the file's own {', '.join(sorted(formats))} blocks, each matrix " \
            f"multiplied in its format as stored"
    shown = ", ".join(sorted(formats)) or "none"
    return "fp32", (f"auto: the file stores its matrices as {shown}; tformer keeps {', '.join(sorted(set(KEPT.values())))} "
                    f"blocks, so it runs widened to float32")


def file_formats(formats: set[str]) -> str:
    """The dtype name of a GGUF kept in several block formats: ``q4_k+q6_k``."""
    return "+".join(sorted(formats))


def _gguf_parts(path: Path, dtype: str, kernels: bool, prepare):
    """Model, tokenizer, template, eos ids, sampling defaults and the dtype chosen, from a GGUF's own header
    and blocks; ``prepare(model)`` is called as soon as the model is built (its path chosen, its tiles begun,
    while the vocabulary and template are read)."""
    from tformer.interop.gguf_import import (gguf_tokenizer, layer_formats, load_gguf_file, stop_token_ids,
                                             tokenizer_config)
    from tformer.interop.gguf_reader import GGUFFile
    from tformer.quant.quantize import BLOCK_FORMATS, set_precision
    from tformer.tokenizers import ChatTemplate

    f = GGUFFile(path)
    formats = layer_formats(f)
    if dtype == AUTO:
        dtype, why = auto_dtype(formats)
    elif formats == {dtype}:
        why = f"--dtype {dtype}: the file's own blocks"
    elif dtype in BLOCK_FORMATS:
        why = f"--dtype {dtype}: re-quantised from the file's {', '.join(sorted(formats))} weights"
    else:
        why = f"--dtype {dtype}"
    keep = dtype == file_formats(formats)        # the file's own format(s): each matrix kept as stored, the rest float
    model = set_precision(load_gguf_file(f, keep_quant=keep), "fp32" if keep else dtype, decode_kernels=kernels)
    prepare(model)
    tokenizer = gguf_tokenizer(f)
    conf = tokenizer_config(f)
    source = conf.pop("chat_template", None)
    special = {k: v for k, v in conf.items() if k.endswith("_token") and isinstance(v, str)}
    template = ChatTemplate(source, **special) if isinstance(source, str) else None
    return model, tokenizer, template, stop_token_ids(f), sampling_defaults(f), dtype, why


def sampling_defaults(f) -> dict:
    """The sampling options a GGUF (a :class:`~tformer.interop.gguf_reader.GGUFFile`) recommends in its
    ``general.sampling.*`` keys, by the generation option each sets; keys absent or not numbers are left out."""
    defaults = {}
    for key, option in SAMPLING_KEYS.items():
        value = f.field(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            defaults[option] = int(value) if option == "top_k" else float(value)
    return defaults


def require_decoder(model, source) -> None:
    """Refuse, in one sentence, a model the commands that open models cannot generate with: a
    sequence-to-sequence run (``train --task seq2seq``) or an encoder, before anything else is read."""
    from tformer.models.decoder import DecoderLM

    if isinstance(model, DecoderLM):
        return
    hint = ("run it with `tformer translate --ckpt RUN`" if hasattr(model, "encoder") and hasattr(model, "decoder")
            else "serve it for embeddings with `tformer serve --embeddings DIR`")
    raise CheckpointError(f"{source} holds a {type(model).__name__}, not a decoder-only language model, so chat, "
                          f"generate, serve and finetune cannot generate with it; {hint}.")


def _folder_parts(folder: Path, kind: str, dtype: str, kernels: bool, prepare):
    """The same from a tformer checkpoint or a HuggingFace folder (its ``generation_config.json`` /
    ``config.json`` naming the eos ids)."""
    from tformer.checkpoint import load_generation_defaults, load_model
    from tformer.interop.hf import load_hf
    from tformer.interop.loader import eos_token_ids
    from tformer.quant.quantize import set_precision
    from tformer.tokenizers import TOKENIZER, load_chat_template, load_tokenizer

    if dtype == AUTO:
        dtype, why = auto_dtype(None)
    else:
        why = f"--dtype {dtype}"
    if kind == "hf":
        model, eos = load_hf(folder), eos_token_ids(folder)
    else:
        model, eos = load_model(folder), list(load_generation_defaults(folder).get("eos_token_id", []))
    require_decoder(model, folder)
    model = set_precision(model.eval(), dtype, decode_kernels=kernels)
    prepare(model)
    tokenizer = load_tokenizer(folder / TOKENIZER) if (folder / TOKENIZER).is_file() else None
    return model, tokenizer, load_chat_template(folder), eos, {}, dtype, why


def special_token_id(template, tokenizer, key: str) -> int | None:
    """The id of the chat template's special token ``key`` (``"eos_token"``, ``"bos_token"``), when it is one
    token of the vocabulary; else None."""
    name = None if template is None else template.special.get(key)
    if not name or tokenizer is None:
        return None
    try:
        ids = tokenizer.encode(name, add_special_tokens=False)
    except Exception:  # noqa: BLE001  a vocabulary without it (a character tokenizer): nothing to add
        return None
    return ids[0] if len(ids) == 1 else None


# Tokens that end a turn, as llama.cpp lists them (its end-of-generation ids): Llama 3's <|eot_id|> and
# <|eom_id|>, ChatML's <|im_end|> (Qwen, SmolLM2), Gemma's <end_of_turn>, Phi-3's <|end|>, ...
END_OF_TURN_TOKENS = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<end_of_turn>", "<|end|>", "<|endoftext|>",
                      "<|end_of_text|>", "<EOT>", "<end_of_utterance>")


def end_of_turn_ids(template, tokenizer) -> list[int]:
    """The ids of the tokens a chat template ends a turn with, which a checkpoint's eos ids may not name:
    its ``eos_token`` when that is one token of the vocabulary (``<|im_end|>`` for SmolLM2's ChatML), and
    each special token of :data:`END_OF_TURN_TOKENS` the template writes (Gemma's ``<end_of_turn>`` where
    the eos token is ``<eos>``, Phi-3.5's ``<|end|>`` where it is ``<|endoftext|>``)."""
    from tformer.tokenizers import special_strings

    if template is None or tokenizer is None:
        return []
    eos = special_token_id(template, tokenizer, "eos_token")
    ids = [] if eos is None else [eos]
    specials = special_strings(tokenizer)
    ids += [specials[t] for t in END_OF_TURN_TOKENS if t in specials and t in template.source]
    return sorted(set(ids))


def require_tokenizer(opened: "OpenedModel") -> None:
    """Refuse, in one sentence saying where a tokenizer comes from, a model opened without one."""
    if opened.tokenizer is not None:
        return
    if opened.kind == "hf":
        raise CheckpointError(f"{opened.source} is a HuggingFace folder without tokenizer.json; put the model's "
                              f"tokenizer.json beside its config.json, or convert it with `tformer convert --from-hf "
                              f"{opened.source} --out CKPT` from a folder that has one and pass CKPT.")
    raise CheckpointError(f"{opened.source} has no tokenizer; pass a checkpoint that holds tokenizer.json or a GGUF "
                          f"with its vocabulary.")


def choose_path(model, background: bool = False) -> tuple[str, str]:
    """``(path, reason)``: ``"whole-layer"`` where the model's steps can run its decoder layers in one C++
    call each (:mod:`tformer.fused`), else ``"module"``, with why. Chosen here, once
    (:func:`tformer.fused.choose` keeps the choice beside the model); generation then only looks it up.
    ``background``: the plan's tiles are made on a thread of their own and waited for at its first use."""
    from tformer.fused import choose

    choice = choose(model, background)
    return ("whole-layer" if choice.plan is not None else "module"), choice.reason


@contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off while a model opens: the objects opening makes would set off a
    full collection, which rescans every object the process tracks (torch's ~10^5 among them) and finds no
    cycles worth freeing."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@contextmanager
def _threads(n: int):
    """torch at ``n`` threads inside, its count restored after. Opening runs hundreds of short copies and
    checks at one: at two each is a parallel region whose second thread, beside a busy neighbour, first
    waits for a time slice (docs/chat.md, "How fast the front door is"); the repacks into tiles, the one
    long stretch, run beside them on a thread of their own, which takes that count at its first repack."""
    threads = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def open_model(spec: str | os.PathLike | None = None, dtype: str = AUTO, threads: int | None = None, *,
               kernels: bool = True) -> OpenedModel:
    """Open a model spec for inference (see the module docstring).

    Args:
        spec: ``smollm2`` (default), a ``.gguf`` file, a checkpoint / run folder or a HuggingFace folder.
        dtype: ``auto`` or a weight format of :func:`tformer.quant.quantize.set_precision`.
        threads: torch threads for this process (``None``: torch's choice less the cores other processes
            kept busy while the model loaded, :class:`tformer.machine.FreeCores`).
        kernels: float linears become the decode kernels' layers; ``False`` keeps plain ``nn.Linear``
            modules, for what needs their parameters and gradients (fine-tuning, interpretability).
    Raises:
        InputError / CheckpointError / ConfigError: a spec, file or dtype that cannot be opened, in one
            sentence.
    """
    from tformer.quant.quantize import WEIGHT_FORMATS

    known = (AUTO, *WEIGHT_FORMATS)
    if dtype not in known:
        raise InputError(f"--dtype {dtype} is not a weight format; choose one of {', '.join(known)}.")
    if threads is not None:
        torch.set_num_threads(threads)
    free = FreeCores()                                    # measured while the model loads, not after it
    start = time.perf_counter()
    name, source, kind = resolve_source(spec)
    chosen: list[tuple[str, str]] = []

    def prepare(model) -> None:         # the path chosen as soon as the model is built; its tiles made beside the rest
        chosen.append(choose_path(model, background=True))

    with _collector_paused(), _threads(1):
        parts = (_gguf_parts(source, dtype, kernels, prepare) if kind == "gguf"
                 else _folder_parts(source, kind, dtype, kernels, prepare))
        model, tokenizer, template, eos, defaults, dtype, why = parts
        if tokenizer is not None and tokenizer.vocab_size > getattr(model.config, "vocab_size", tokenizer.vocab_size):
            raise CheckpointError(f"{source}: the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                                  f"{model.config.vocab_size}; the checkpoint is inconsistent; use another one.")
        stop = sorted(set(int(i) for i in eos) | set(end_of_turn_ids(template, tokenizer)))
    (path, path_why), = chosen
    if threads is None:
        torch.set_num_threads(free.threads(torch.get_num_threads()))   # the cores others leave free now
    return OpenedModel(model, tokenizer, template, stop, defaults, name, source, dtype, why, path, path_why,
                       time.perf_counter() - start, kind)
