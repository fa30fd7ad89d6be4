"""``tformer convert``: HuggingFace folder <-> tformer checkpoint folder.

    tformer convert --from-hf HF_DIR --out CKPT_DIR     # config.json + *.safetensors -> tformer
    tformer convert --to-hf CKPT_DIR --out HF_DIR       # tformer -> folder transformers loads
    tformer convert --to-gguf CKPT_DIR --out MODEL.gguf [--type f32|f16|bf16|q8_0|q4_0|q4_1]   # -> llama.cpp
    tformer convert --from-gguf MODEL.gguf --out CKPT_DIR   # llama.cpp file -> tformer (float32, tokenizer,
                                                            # chat template)
    tformer convert --from-nanogpt ckpt.pt --out CKPT_DIR [--vocab-text input.txt]   # nanoGPT's train.py
                                                            # checkpoint -> tformer (a character model's
                                                            # vocabulary rebuilt from its text)

A non-empty --out is refused unless --force is given, and then replaced whole: the new folder is
written beside it under a hidden name and swapped in by two renames once complete, so no file of
the old model (a tokenizer, a generation_config.json) survives next to the new weights, and a
failed conversion leaves the old folder as it was.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
from pathlib import Path

from tformer.errors import InputError

# Files that travel with the weights unchanged (tokenizer, sentence-transformers settings).
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt", "vocab.json",
              "merges.txt", "chat_template.jinja", "sentence_bert_config.json", "modules.json", "1_Pooling/config.json")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert", help="import/export HuggingFace checkpoints (every family of "
                                       "tformer.interop.hf.FAMILIES; docs/interop.md) and GGUF files",
                       description="Convert a HuggingFace folder (config.json + safetensors, sharded or not) to "
                                   "a tformer checkpoint, or a tformer checkpoint back to a HuggingFace folder "
                                   "that transformers' from_pretrained loads; or a GGUF file (llama.cpp) to and "
                                   "from a tformer checkpoint.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-hf", metavar="DIR", help="HuggingFace model folder to import")
    src.add_argument("--to-hf", metavar="CKPT", help="tformer checkpoint folder to export")
    src.add_argument("--from-gguf", metavar="FILE", help="GGUF file to import (llama, qwen2, gpt2; dequantised to "
                                                         "float32, with its tokenizer and chat template)")
    src.add_argument("--from-nanogpt", metavar="FILE", help="a ckpt.pt written by nanoGPT's train.py to import "
                                                            "(weights and shape; its tokenizer is not in the file)")
    src.add_argument("--to-gguf", metavar="CKPT", help="tformer checkpoint folder to export as one GGUF file "
                                                       "(llama.cpp; GPT-2 and Llama layouts)")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder (created; must be empty or new); "
                                                                "with --to-gguf the .gguf file")
    p.add_argument("--type", default="f32", choices=["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1"],
                   help="with --to-gguf: type of the weight matrices (norms and biases stay f32)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out folder whole")
    p.add_argument("--vocab-text", metavar="FILE", default=None,
                   help="with --from-nanogpt: the text a character model's data was prepared from (e.g. "
                        "data/shakespeare_char/input.txt); its sorted distinct characters are the vocabulary, "
                        "saved as tokenizer.json")
    p.add_argument("--model-type", default=None,
                   help="with --to-hf: HF model_type (e.g. gpt2, llama, bert, bart; an unknown one is refused "
                        "with the list); default inferred from the config")
    p.add_argument("--max-shard-mb", type=float, default=None,
                   help="with --to-hf: split weights into shards of at most this many MB plus an index")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tformer.checkpoint import load_model, resolve_checkpoint, save_model
    from tformer.interop.hf import FAMILIES, load_hf, save_hf
    from tformer.interop.loader import eos_token_ids

    if args.max_shard_mb is not None:
        if not args.to_hf:
            raise InputError("--max-shard-mb applies to --to-hf only (a .gguf file and a tformer checkpoint are "
                             "one file); leave it out.")
        if not (math.isfinite(args.max_shard_mb) and args.max_shard_mb > 0):
            raise InputError(f"--max-shard-mb {args.max_shard_mb} must be > 0 and finite.")
    if args.to_gguf:
        return to_gguf(args)
    if args.from_gguf:
        return from_gguf(args)
    if args.from_nanogpt:
        return from_nanogpt(args)
    if args.vocab_text is not None:
        raise InputError("--vocab-text applies to --from-nanogpt only (the other sources carry their tokenizer); "
                         "leave it out.")
    if args.model_type is not None and args.model_type not in FAMILIES:
        raise InputError(f"--model-type {args.model_type} is not supported; choose one of {', '.join(FAMILIES)}.")
    source_arg, out = Path(args.from_hf or args.to_hf), Path(args.out)
    if source_arg.resolve() == out.resolve():
        raise InputError(f"--out {args.out} is the source folder; write the converted model to a new folder.")
    check_target(out, args.force)
    if args.from_hf:
        source = Path(args.from_hf)
        model = load_hf(source)
        eos = eos_token_ids(source)
        with replacing(out) as stage:
            save_model(stage, model, generation={"eos_token_id": eos} if eos else None)
            copied = copy_side_files(source, stage)
    else:
        source = resolve_checkpoint(args.to_hf)
        model = load_model(source)
        shard = int(args.max_shard_mb * 1e6) if args.max_shard_mb else None
        with replacing(out) as stage:
            save_hf(model, stage, model_type=args.model_type, max_shard_bytes=shard)
            copied = copy_side_files(source, stage)
    c = model.config
    print(f"{type(model).__name__} ({c.name}): {c.n_layers} layers, d_model {c.d_model}, {c.n_heads} heads "
          f"({c.n_kv_heads} kv), {sum(p.numel() for p in model.parameters()):,} parameters -> {out}")
    if copied:
        print(f"copied {', '.join(copied)}")
    return 0


def to_gguf(args: argparse.Namespace) -> int:
    """``--to-gguf``: one .gguf file (an existing file is replaced only with --force)."""
    from tformer.checkpoint import load_model, resolve_checkpoint
    from tformer.interop.gguf import save_gguf
    from tformer.interop.loader import eos_token_ids

    out = Path(args.out)
    if out.is_dir() or (out.exists() and not args.force):
        raise InputError(f"--out {out} exists; pass a new .gguf file name (or --force to replace a file).")
    source = resolve_checkpoint(args.to_gguf)
    model = load_model(source)
    r = save_gguf(model, out, args.type, args.model_type, tokenizer_dir=source, eos=eos_token_ids(source))
    types = ", ".join(f"{n} {t}" for t, n in r["types"].items())
    print(f"{r['arch']} GGUF: {r['tensors']} tensors ({types}), {r['tokenizer']} -> {out}")
    return 0


def from_gguf(args: argparse.Namespace) -> int:
    """``--from-gguf``: a checkpoint folder with the model, its tokenizer and its chat template."""
    from tformer.interop.gguf_import import convert_gguf

    out = Path(args.out)
    check_target(out, args.force)
    with replacing(out) as stage:
        r = convert_gguf(args.from_gguf, stage)
    m = r["model"]
    c = m.config
    extras = [name for name, have in (("tokenizer", r["tokenizer"]), ("chat template", r["chat_template"])) if have]
    print(f"{type(m).__name__} ({c.name}): {c.n_layers} layers, d_model {c.d_model}, {c.n_heads} heads "
          f"({c.n_kv_heads} kv), {sum(p.numel() for p in m.parameters()):,} parameters, float32"
          f"{', with ' + ' and '.join(extras) if extras else ''} -> {out}")
    return 0


def from_nanogpt(args: argparse.Namespace) -> int:
    """``--from-nanogpt``: a checkpoint folder with nanoGPT's model, and with ``--vocab-text`` its
    character vocabulary (nanoGPT keeps its vocabulary outside the checkpoint)."""
    from tformer.checkpoint import save_model
    from tformer.interop.nanogpt import char_tokenizer, load_nanogpt
    from tformer.tokenizers import TOKENIZER

    out = Path(args.out)
    check_target(out, args.force)
    model = load_nanogpt(args.from_nanogpt)
    tok = char_tokenizer(args.vocab_text, model.config.vocab_size) if args.vocab_text else None
    with replacing(out) as stage:
        save_model(stage, model)
        if tok is not None:
            tok.save(stage / TOKENIZER)
    c = model.config
    vocab = (f"a {tok.vocab_size}-character tokenizer" if tok else
             "no tokenizer (token ids in and out; --vocab-text for a character model)")
    print(f"{type(model).__name__} (nanoGPT): {c.n_layers} layers, d_model {c.d_model}, {c.n_heads} heads, "
          f"context {c.context_length}, vocabulary {c.vocab_size}, {sum(p.numel() for p in model.parameters()):,} "
          f"parameters, float32, {vocab} -> {out}")
    return 0


def check_target(out: Path, force: bool) -> None:
    """Refuse an --out that is a file, or a non-empty folder without ``force``."""
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} is a file, not a folder; pass a new folder (it is created).")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise InputError(f"--out {out} is not empty; pass --force to replace it whole, or choose a new folder.")


class replacing:
    """``with replacing(out) as stage:`` write the whole folder into ``stage``; on success it takes
    ``out``'s place (the old ``out``, if any, is removed); on failure ``out`` is left untouched."""

    def __init__(self, out: Path):
        self.out = out

    def __enter__(self) -> Path:
        from tformer.io import current_umask

        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.stage = Path(tempfile.mkdtemp(dir=self.out.parent, prefix=f".{self.out.name}.new-"))
        except OSError as e:   # name the folder the user gave, not the hidden staging one
            raise OSError(e.errno, e.strerror, str(self.out)) from e
        os.chmod(self.stage, 0o777 & ~current_umask())  # mkdtemp makes 0700; give it a plain mkdir's mode
        return self.stage

    def __exit__(self, kind, value, tb) -> None:
        if kind is not None:
            shutil.rmtree(self.stage, ignore_errors=True)
            return
        old = None
        if self.out.exists():
            old = Path(tempfile.mkdtemp(dir=self.out.parent, prefix=f".{self.out.name}.old-"))
            os.replace(self.out, old / "x")
        os.replace(self.stage, self.out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def copy_side_files(source: Path, out: Path) -> list[str]:
    """Copy the tokenizer and sentence-transformers files along (not tformer's own tokenizer format)."""
    copied = []
    for name in SIDE_FILES:
        if (source / name).is_file() and not _is_tformer_tokenizer(source / name):
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source / name, out / name)
            copied.append(name)
    return copied


def _is_tformer_tokenizer(path: Path) -> bool:
    """tformer's own tokenizer.json ({"kind": ...}) means nothing to HuggingFace."""
    if path.name != "tokenizer.json":
        return False
    try:
        return "kind" in json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
