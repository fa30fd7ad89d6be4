"""tformer checkpoint -> GGUF file (llama.cpp's format), for GPT-2- and Llama-layout decoders.

    tformer convert --to-gguf CKPT --out MODEL.gguf [--type f32|f16|bf16|q8_0|q4_0|q4_1]

The weights go through the HF converters first (``tformer.interop.hf``: the model as transformers
would hold it), then each HF name is mapped to llama.cpp's name by the ``gguf`` package's own
``TensorNameMap`` (``transformer.h.0.attn.c_attn.weight`` -> ``blk.0.attn_qkv.weight``). Two
layout changes follow llama.cpp's ``convert_hf_to_gguf.py`` (ggml-org/llama.cpp, classes
``GPT2Model`` and ``LlamaModel``; the metadata keys are those ``llama.cpp/src/llama-model.cpp`` reads for
``LLM_ARCH_GPT2`` / ``LLM_ARCH_LLAMA``, listed in :data:`REQUIRED_KEYS`):

- GPT-2's ``Conv1D`` weights ``(in, out)`` are transposed back to ``nn.Linear``'s ``(out, in)``.
- Llama's Q and K rows are permuted from HF's rotate-half RoPE layout (dimension j pairs with
  j + d/2 inside a head) to llama.cpp's interleaved one (2i pairs with 2i+1): per head, the row
  index (half h, i) moves to (i, half h), i.e. ``W.reshape(heads, 2, d/2, -1).swapaxes(1, 2)``.

Types: 1-D tensors (norms, biases) stay f32, as llama.cpp keeps them; 2-D tensors take ``--type``
(q8_0, q4_0 and q4_1 need rows that are a multiple of 32 long; other rows fall back to f16, and the
report says which). ``gguf.quants`` does the f16/bf16/q8_0/q4_0/q4_1 encoding.

Tokenizer: an HF ``tokenizer.json`` of byte-level BPE (GPT-2, Llama 3 style) next to the weights
is written as ``tokenizer.ggml.model = "gpt2"`` with its tokens, token types and merges, and
``tokenizer.ggml.pre`` named by its pre-tokenizer (Llama 3's split: ``llama-bpe``, Qwen's: ``qwen2``). tformer's
own char/BPE tokenizers have no llama.cpp counterpart: for them (and when there is no tokenizer)
``tokenizer.ggml.model = "none"`` is written, so llama.cpp runs the model on token ids only
(``llama-bench``, the id-level API), and the command says so. Any other HF tokenizer is refused.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

from tformer.errors import CheckpointError, InputError

TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1")
ARCHES = {"gpt2": "gpt2", "llama": "llama"}          # tformer/HF model_type -> GGUF general.architecture
# The hyper-parameter keys llama.cpp reads (and requires) for each architecture ("{arch}." prefix).
REQUIRED_KEYS = {
    "gpt2": ("context_length", "embedding_length", "feed_forward_length", "block_count", "attention.head_count",
             "attention.layer_norm_epsilon"),
    "llama": ("context_length", "embedding_length", "feed_forward_length", "block_count", "attention.head_count",
              "attention.head_count_kv", "attention.layer_norm_rms_epsilon", "rope.dimension_count",
              "rope.freq_base"),
}
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def llama_rope_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """HF rotate-half rows -> llama.cpp interleaved rows, per head: (heads*d, in) -> same shape."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(model: torch.nn.Module, model_type: str) -> dict[str, np.ndarray]:
    """llama.cpp's tensor names -> float32 arrays in its layout (``(out, in)`` for matrices)."""
    import gguf

    from tformer.interop.hf import check_plain, family

    c = model.config
    module = family(model_type, "model_type")
    check_plain(c, model_type, module)          # the switches no exported family has (soft-caps, Gemma's)
    module.check_exportable(c, model_type)
    state = {k: v.detach().to("cpu", torch.float32) for k, v in model.state_dict().items()}
    names = gguf.TensorNameMap(gguf.MODEL_ARCH[ARCHES[model_type].upper()], c.n_layers)
    out = {}
    for hf_name, t in module.state_to_hf(state, c).items():
        a = t.numpy()
        if model_type == "gpt2" and hf_name.endswith(CONV1D):
            a = a.T                                             # Conv1D (in, out) -> (out, in)
        if model_type == "llama" and ".self_attn.q_proj." in hf_name:     # weight and bias alike
            a = llama_rope_permute(a, c.n_heads)
        if model_type == "llama" and ".self_attn.k_proj." in hf_name:
            a = llama_rope_permute(a, c.n_kv_heads)
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise CheckpointError(f"tensor {hf_name} has no GGUF name for {model_type}; only plain GPT-2 and "
                                  f"Llama layouts can be exported to GGUF.")
        out[name] = np.ascontiguousarray(a)
    return out


def write_metadata(w, c, model_type: str, file_type) -> None:
    """The ``{arch}.*`` hyper-parameters llama.cpp reads (see :data:`REQUIRED_KEYS`)."""
    w.add_name(c.name)
    w.add_context_length(c.context_length)
    w.add_embedding_length(c.d_model)
    w.add_feed_forward_length(c.d_ff)
    w.add_block_count(c.n_layers)
    w.add_head_count(c.n_heads)
    w.add_file_type(file_type)
    w.add_vocab_size(c.vocab_size)      # llama.cpp sizes its token table from it when there is no tokenizer
    if model_type == "gpt2":
        w.add_layer_norm_eps(c.norm_eps)
    else:
        w.add_head_count_kv(c.n_kv_heads)
        w.add_layer_norm_rms_eps(c.norm_eps)
        w.add_rope_dimension_count(c.head_dim)
        w.add_rope_freq_base(float(c.rope_base))
        if c.head_dim != c.d_model // c.n_heads:              # llama.cpp assumes d_model / heads otherwise
            w.add_key_length(c.head_dim)
            w.add_value_length(c.head_dim)
        write_rope_scaling(w, c)


def write_rope_scaling(w, c) -> None:
    """A scaled RoPE as llama.cpp reads it (:mod:`tformer.interop.gguf_rope`): ``linear`` and ``yarn`` as
    ``rope.scaling.*`` keys (YaRN's attention factor as llama.cpp's multiplier of its own default), ``llama3``
    and ``factors`` as the divisors ``rope_freqs.weight``."""
    import gguf

    from tformer.interop.gguf_rope import divisors

    s = c.rope_scaling
    if s is None:
        return
    if s["rope_type"] in ("linear", "yarn"):
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR if s["rope_type"] == "linear" else gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(s["factor"]))
    if s["rope_type"] == "yarn":
        w.add_rope_scaling_orig_ctx_len(int(s["original_max_position_embeddings"]))
        w.add_rope_scaling_yarn_beta_fast(float(s.get("beta_fast", 32.0)))
        w.add_rope_scaling_yarn_beta_slow(float(s.get("beta_slow", 1.0)))
        if s.get("truncate", True) is False:
            raise InputError("YaRN with truncate=false has no GGUF key (llama.cpp always rounds the ramp's ends); "
                             "export it to HuggingFace instead.")
        if s.get("attention_factor") is not None:
            w.add_rope_scaling_yarn_attn_factor(float(s["attention_factor"]) / (0.1 * math.log(s["factor"]) + 1.0))
    freqs = divisors(s, c.head_dim, c.rope_base)
    if freqs is not None:
        w.add_tensor("rope_freqs.weight", freqs)


def hf_bpe_tokenizer(folder: Path) -> dict | None:
    """The HF ``tokenizer.json`` of ``folder`` when it is one (``None`` for none or tformer's own)."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        return None
    tok = json.loads(path.read_text(encoding="utf-8"))
    if "kind" in tok:                                          # tformer's own tokenizer format
        return None
    model = tok.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        kind = "SentencePiece-style BPE (byte fallback)" if model.get("type") == "BPE" else model.get("type")
        raise InputError(f"{path} is a {kind} tokenizer; GGUF export writes only byte-level BPE tokenizers, so "
                         f"remove tokenizer.json to export the weights alone.")
    tok["gguf_pre"] = gguf_pre(tok, path)
    return tok


def gpt2_split(tok: dict) -> bool:
    """Whether the tokenizer splits text as GPT-2 does (a ByteLevel pre-tokenizer with its regex), which
    llama.cpp calls ``tokenizer.ggml.pre = "gpt-2"``; its ``"default"`` splits punctuation and digits apart."""
    pre = tok.get("pre_tokenizer") or {}
    return pre.get("type") == "ByteLevel" and pre.get("use_regex", True)


def gguf_pre(tok: dict, path: Path) -> str | None:
    """llama.cpp's name (``tokenizer.ggml.pre``) for a tokenizer.json that splits text by regular
    expressions before its bytes (``Split``s then ``ByteLevel``: Llama 3's ``llama-bpe``, Qwen's ``qwen2``,
    SmolLM's ``smollm``, GPT-2's ``gpt-2``); ``None`` for any other layout (GPT-2's own ByteLevel regex, or
    "default"). Expressions llama.cpp has no name for are refused: llama.cpp would split the text
    otherwise, and so give other ids."""
    from tformer.tokenizers import GGUF_PRE_SPLITS, HF_PRE_SPLITS

    pre = tok.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers") or [] if pre.get("type") == "Sequence" else []
    kinds = [p.get("type") for p in parts]
    if len(kinds) < 2 or kinds != ["Split"] * (len(kinds) - 1) + ["ByteLevel"]:
        return None
    regexes = [(p.get("pattern") or {}).get("Regex") for p in parts[:-1]]
    # one name per split: GGUF_PRE_SPLITS also holds aliases; the names written are those llama.cpp lists first
    names = {tuple(GGUF_PRE_SPLITS[n]): n for n in ("smollm", "gpt-2", "llama-bpe", "qwen2")}
    names.update({(r,): n for n, r in HF_PRE_SPLITS.items()})
    name = names.get(tuple(regexes))
    if name is None:
        raise InputError(f"{path} splits text by the expression {str(regexes[0])[:60]!r}..., which is none llama.cpp "
                         f"has a name for (tformer writes {', '.join(sorted(set(names.values())))}); remove "
                         f"tokenizer.json to export the weights alone.")
    return name


def write_tokenizer(w, tok: dict | None, model_type: str, vocab_size: int, eos: list[int]) -> str:
    """``tokenizer.ggml.*`` keys; returns one phrase for the report."""
    if tok is None:
        w.add_tokenizer_model("none")
        return "no llama.cpp tokenizer (tokenizer.ggml.model = none: token ids in, token ids out)"
    vocab = dict(tok["model"]["vocab"])
    special = {a["content"]: a["id"] for a in tok.get("added_tokens", [])}
    vocab.update(special)
    by_id = {i: s for s, i in vocab.items()}
    if sorted(by_id) != list(range(len(by_id))) or len(by_id) > vocab_size:
        raise InputError(f"the tokenizer's ids are not 0..{len(by_id) - 1} within the model's {vocab_size} "
                         f"embeddings; export with a tokenizer that matches the model.")
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]   # llama.cpp wants one token per row
    types = [3 if t in special else (5 if i >= len(by_id) else 1) for i, t in enumerate(tokens)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"].get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(tok.get("gguf_pre") or ("gpt-2" if model_type == "gpt2" or gpt2_split(tok) else "default"))
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    if eos:
        w.add_eos_token_id(eos[0])
    return f"byte-level BPE tokenizer ({len(by_id)} tokens, {len(merges)} merges)"


def encode(a: np.ndarray, kind: str) -> tuple[np.ndarray, object, str]:
    """(array for GGUFWriter.add_tensor, raw_dtype or None, type written)."""
    import gguf

    q = gguf.GGMLQuantizationType
    if a.ndim < 2 or kind == "f32":
        return a.astype(np.float32), None, "f32"
    if kind in ("q8_0", "q4_0", "q4_1") and a.shape[-1] % 32 != 0:
        kind = "f16"                                          # Q8_0/Q4_0 blocks are 32 values of one row
    if kind == "f16":
        return a.astype(np.float16), None, "f16"
    qt = {"bf16": q.BF16, "q8_0": q.Q8_0, "q4_0": q.Q4_0, "q4_1": q.Q4_1}[kind]
    return gguf.quants.quantize(a.astype(np.float32), qt), qt, kind


def save_gguf(model: torch.nn.Module, path: str | Path, kind: str = "f32", model_type: str | None = None,
              tokenizer_dir: Path | None = None, eos: list[int] | None = None) -> dict:
    """Write ``model`` as a GGUF file llama.cpp loads.

    Args:
        model: a GPT-2- or Llama-layout :class:`DecoderLM`.
        path: the ``.gguf`` file (written atomically).
        kind: the type of 2-D tensors, one of :data:`TYPES`.
        model_type: ``gpt2`` or ``llama``; default inferred from the config.
        tokenizer_dir: folder holding an HF ``tokenizer.json`` to embed (optional).
        eos: end-of-sequence ids (the first becomes ``tokenizer.ggml.eos_token_id``).
    Returns:
        ``{"arch", "tensors", "types" (count per type written), "tokenizer" (a phrase)}``.
    """
    import gguf

    from tformer.io import atomic_write
    from tformer.interop.hf import infer_model_type

    if kind not in TYPES:
        raise InputError(f"--type {kind} is not supported; choose one of {', '.join(TYPES)}.")
    model_type = model_type or infer_model_type(model.config)
    if model_type not in ARCHES:
        raise InputError(f"a {model_type} model cannot be exported to GGUF yet; only GPT-2 and Llama layouts can.")
    tensors = gguf_tensors(model, model_type)
    tok = hf_bpe_tokenizer(Path(tokenizer_dir)) if tokenizer_dir else None
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                 "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1}[kind]
    report = {"arch": ARCHES[model_type], "tensors": len(tensors), "types": {}}

    def write(tmp: str) -> None:
        w = gguf.GGUFWriter(tmp, ARCHES[model_type])
        write_metadata(w, model.config, model_type, file_type)
        report["tokenizer"] = write_tokenizer(w, tok, model_type, model.config.vocab_size, eos or [])
        for name, a in tensors.items():
            data, raw, written = encode(a, kind)
            w.add_tensor(name, data, raw_dtype=raw)
            report["types"][written] = report["types"].get(written, 0) + 1
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    atomic_write(path, write)
    return report
