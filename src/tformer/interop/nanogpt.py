"""nanoGPT -> tformer: a ``ckpt.pt`` that nanoGPT's ``train.py`` wrote, as a tformer model.

nanoGPT's ``GPT`` is GPT-2's architecture written with ``nn.Linear``: learned positions, pre-norm
LayerNorm (with or without biases, ``bias``), the exact-erf GELU (``nn.GELU()``, where GPT-2 uses the
tanh form), [W_Q; W_K; W_V] in one ``c_attn`` with heads contiguous, and the head tied to the token
embedding. So its tensors map one to one onto tformer's (GPT-2's table in :mod:`tformer.interop.gpt2`
without the Conv1D transpose), and the model is tformer's ``recipe=classic`` decoder.

The file is read with ``torch.load(weights_only=True)`` (tensors, numbers, strings and containers
only; nothing in it is executed). A ``torch.compile``'d run saves its names under ``_orig_mod.``;
that prefix is removed. The tokenizer is not in the checkpoint: nanoGPT keeps a character vocabulary
in ``meta.pkl``, a pickle tformer does not unpickle, or uses GPT-2's BPE. A character model's
vocabulary is the sorted distinct characters of its training text (nanoGPT's ``prepare.py``), which is
exactly :class:`~tformer.tokenizers.CharTokenizer`'s, so :func:`char_tokenizer` rebuilds it from that
text; otherwise the model takes and gives token ids.
"""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path

import torch

from tformer.config import TransformerConfig
from tformer.errors import CheckpointError, InputError
from tformer.interop.gpt2 import LAYER as GPT2_LAYER
from tformer.interop.loader import TensorSource
from tformer.models.decoder import DecoderLM
from tformer.tokenizers import CharTokenizer

PREFIX = "transformer."
COMPILED = "_orig_mod."                   # torch.compile's wrapper module, in a compiled run's names
LAYER = [(ours, theirs) for ours, theirs, _ in GPT2_LAYER]        # (tformer, nanoGPT) under blocks.{i} / h.{i}
TOP = [("tok_emb.weight", "wte.weight"), ("pos_emb.weight", "wpe.weight"),
       ("final_norm.weight", "ln_f.weight"), ("final_norm.bias", "ln_f.bias")]
MODEL_ARGS = ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size")


def config_from_nanogpt(model_args: dict) -> TransformerConfig:
    """The :class:`TransformerConfig` of nanoGPT's ``model_args`` (its ``GPTConfig`` fields); dropout
    is a training setting and is left at 0.

    Raises:
        CheckpointError: a field the shape needs is missing.
    """
    missing = [k for k in MODEL_ARGS if k not in model_args]
    if missing:
        raise CheckpointError(f"the checkpoint's model_args lack {', '.join(missing)}; is this a ckpt.pt written "
                              f"by nanoGPT's train.py?")
    d = int(model_args["n_embd"])
    return TransformerConfig(
        vocab_size=int(model_args["vocab_size"]), context_length=int(model_args["block_size"]),
        n_layers=int(model_args["n_layer"]), d_model=d, n_heads=int(model_args["n_head"]), d_ff=4 * d,
        positions="learned", norm="layernorm", norm_eps=1e-5, norm_placement="pre", ffn="mlp",
        activation="gelu", bias=bool(model_args["bias"]), tie_embeddings=True, causal=True, name="nanogpt")


def state_from_nanogpt(state: dict[str, torch.Tensor], c: TransformerConfig) -> dict[str, torch.Tensor]:
    """tformer's state dict from nanoGPT's ``model.state_dict()``.

    Raises:
        CheckpointError: a tensor the config needs is missing, a tensor is left over (named), or the
            head differs from the token embedding it is tied to.
    """
    state = {(k[len(COMPILED):] if k.startswith(COMPILED) else k): v for k, v in state.items()}
    src = TensorSource(state, prefix=PREFIX)
    src.drop(*[f"h.{i}.attn.bias" for i in range(c.n_layers)])       # the causal mask buffer (no flash attention)
    names = TOP if c.bias else [(o, t) for o, t in TOP if not o.endswith(".bias")]
    out = {ours: src.take(theirs) for ours, theirs in names}
    for i in range(c.n_layers):
        for ours, theirs in LAYER:
            if ours.endswith(".bias") and not c.bias:
                continue
            out[f"blocks.{i}.{ours}"] = src.take(f"h.{i}.{theirs}")
    out["lm_head.weight"] = src.take_lm_head(out["tok_emb.weight"], tied=True)
    src.check_consumed()
    return out


def model_from_nanogpt(model_args: dict, state: dict[str, torch.Tensor]) -> DecoderLM:
    """A tformer :class:`DecoderLM` (eval mode, float32) holding nanoGPT's weights.

    Raises:
        CheckpointError: as :func:`config_from_nanogpt` and :func:`state_from_nanogpt`, or a tensor
            whose shape ``model_args`` does not give.
    """
    config = config_from_nanogpt(model_args)
    weights = state_from_nanogpt(state, config)
    model = DecoderLM(config)
    try:
        model.load_state_dict({k: v.to(torch.float32) for k, v in weights.items()}, strict=True)
    except RuntimeError as e:                  # a tensor whose shape model_args does not give
        first = next((line.strip() for line in str(e).splitlines() if "size mismatch" in line), str(e).splitlines()[0])
        raise CheckpointError(f"the weights do not fit the checkpoint's model_args ({first}).") from e
    return model.eval()


def load_nanogpt(path: str | Path) -> DecoderLM:
    """The model in a nanoGPT ``ckpt.pt``.

    Raises:
        CheckpointError: the file is missing, is not a torch checkpoint that loads with
            ``weights_only=True``, lacks ``model`` / ``model_args``, or its tensors do not fit.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path} is not a file; pass the ckpt.pt that nanoGPT's train.py wrote.")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, zipfile.BadZipFile, RuntimeError, EOFError, ValueError) as e:   # not a checkpoint
        raise CheckpointError(f"{path} does not load as a torch checkpoint of tensors and plain values "
                              f"({type(e).__name__}); pass the ckpt.pt that nanoGPT's train.py wrote.") from e
    if not isinstance(ckpt, dict) or "model" not in ckpt or "model_args" not in ckpt:
        raise CheckpointError(f"{path} has no 'model' and 'model_args' entries; pass the ckpt.pt that nanoGPT's "
                              f"train.py wrote.")
    return model_from_nanogpt(ckpt["model_args"], ckpt["model"])


def char_tokenizer(text_path: str | Path, vocab_size: int) -> CharTokenizer:
    """The character vocabulary of a nanoGPT character model, rebuilt from the text it was prepared
    from (``data/shakespeare_char/input.txt`` for nanoGPT's shakespeare_char).

    Raises:
        InputError: the file cannot be read as UTF-8 text, or its distinct characters are not
            ``vocab_size`` (not the text the model was trained on).
    """
    try:
        text = Path(text_path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read {text_path} as UTF-8 text ({e.__class__.__name__}); pass the text the "
                         f"model's data was prepared from.") from e
    tok = CharTokenizer.train(text)
    if tok.vocab_size != vocab_size:
        raise InputError(f"{text_path} has {tok.vocab_size} distinct characters but the model's vocabulary is "
                         f"{vocab_size}; pass the text its data was prepared from (e.g. data/shakespeare_char/"
                         f"input.txt).")
    return tok
