"""GGUF file (llama.cpp's format) -> tformer model, tokenizer and chat template.

    model = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")          # DecoderLM, float32, eval mode
    tformer convert --from-gguf FILE.gguf --out CKPT                # a checkpoint folder with tokenizer

Architectures (``general.architecture``): ``llama`` (Llama 1-3, Mistral-style, SmolLM2), ``qwen2``,
``qwen3``, ``phi3`` (Phi-3 / 3.5-mini: ``attn_qkv`` and ``ffn_up`` holding [gate; up] as HF's fused
``qkv_proj`` / ``gate_up_proj``, LongRoPE in ``rope_factors_long`` / ``rope_factors_short``), ``gemma2``,
``gemma3`` (text) and ``gpt2``, which include every file ``tformer convert --to-gguf``
writes. The metadata becomes an HF ``config.json`` dict and llama.cpp's tensor names become HF names, so the
HF family converters (``tformer.interop.llama``, ``phi3``, ``gemma2``, ``gemma3``, ``gpt2`` ...) build the model
and refuse what they cannot express. Two
layout changes undo what llama.cpp's ``convert_hf_to_gguf.py`` did (see ``tformer.interop.gguf``):

- ``llama`` Q and K rows are stored for interleaved RoPE (dimension 2i pairs with 2i+1); tformer
  and HF rotate halves (j pairs with j + d/2). Per head the stored row (i, half h) goes back to
  (half h, i): ``W.reshape(heads, d/2, 2, -1).swapaxes(1, 2)``, the inverse of
  :func:`tformer.interop.gguf.llama_rope_permute`. ``qwen2`` and ``qwen3`` files are stored in
  rotate-half order already (llama.cpp runs them with NEOX RoPE), so they are not permuted; nor are
  ``gemma2`` and ``gemma3``, whose norm gains are stored as ``1 + w`` (tformer's ``norm_unit_offset``
  keeps ``w``: one is subtracted), and whose layer kinds, gemma3's local RoPE base and the score scale
  are llama.cpp's fixed choices (:func:`tformer.interop.gguf_import.gemma_config`).

Scaled RoPE (:mod:`tformer.interop.gguf_rope`): ``rope.scaling.type`` ``linear`` or ``yarn`` with its
keys, or Llama 3.1's scaling baked into ``rope_freqs.weight`` (one divisor per frequency), become
``config.rope_scaling``.
- ``gpt2`` matrices are stored ``(out, in)``; HF's ``Conv1D`` wants ``(in, out)``.

Every tensor is dequantised to float32 by ``gguf.quants`` (:mod:`tformer.interop.gguf_reader`), unless
``keep_quant=True``: then every matrix stored as Q8_0, Q4_0 or Q4_1 stays in its file bytes and runs as
a :class:`~tformer.quant.block_linear.BlockLinear` (the embedding as a
:class:`~tformer.quant.block_embedding.BlockEmbedding`, a tied LM head over the same bytes): llama.cpp's
arithmetic (activations rounded to 8-bit blocks, integer block products), no float copy of those
weights in the model. The two layout changes are exact on blocks: the RoPE un-permutation moves
whole rows, and q, k, v stay three tensors (views of the file; the un-permuted q and k of a ``llama`` file
are copies), one ``qkv_proj`` as a :class:`~tformer.quant.block_linear.JoinedLinear` (one format) or a
:class:`~tformer.quant.block_linear.StackedLinear` (several), never joined into a copy at the open; a
``gpt2`` file (whose matrices would have to be transposed) is refused with ``keep_quant``.
Metadata that tformer cannot honour is refused with one sentence naming the key: an architecture
it does not implement, a RoPE scaling other than these, mixture-of-experts, or any ``{arch}.*`` key it does not know.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import torch

from tformer.errors import CheckpointError
from tformer.interop.gguf import CONV1D
from tformer.interop.gguf_reader import GGUFFile
from tformer.interop.gguf_rope import ROPE_KEYS, check_rope, rope_scaling
from tformer.interop.loader import TensorSource
from tformer.quant import kblocks, pages

ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gpt2", "gemma2", "gemma3")
ARCH_MODEL_TYPES = {"gemma3": "gemma3_text"}          # architecture -> HF model_type, where they differ
# The "{arch}." keys understood; any other one is refused (it may change the maths).
KNOWN_KEYS = {
    "llama": {"context_length", "embedding_length", "feed_forward_length", "block_count", "attention.head_count",
              "attention.head_count_kv", "attention.layer_norm_rms_epsilon", "rope.dimension_count", "rope.freq_base",
              "vocab_size", "attention.key_length", "attention.value_length", "expert_count",
              "expert_used_count", *ROPE_KEYS},
    "gpt2": {"context_length", "embedding_length", "feed_forward_length", "block_count", "attention.head_count",
             "attention.layer_norm_epsilon", "vocab_size"},
}
KNOWN_KEYS["qwen2"] = KNOWN_KEYS["qwen3"] = KNOWN_KEYS["llama"]
# Gemma: llama.cpp fixes the layer kinds (gemma2: every 2nd layer global; gemma3: every 6th) and gemma3's local
# RoPE base (10,000); these keys are all it reads beside Llama's
KNOWN_KEYS["gemma2"] = KNOWN_KEYS["llama"] | {"attention.sliding_window", "attn_logit_softcapping",
                                              "final_logit_softcapping"}
KNOWN_KEYS["gemma3"] = KNOWN_KEYS["llama"] | {"attention.sliding_window"}
GEMMA_PATTERN = {"gemma2": 2, "gemma3": 6}
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # llama.cpp scales scores by (d / heads)^-1/2 there, else head_dim's
KNOWN_KEYS["phi3"] = KNOWN_KEYS["llama"] | {"attention.sliding_window"}

# llama.cpp tensor name (under blk.{i}. for layers) -> HF name (under model.layers.{i}. / transformer.h.{i}.).
LLAMA_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
LLAMA_LAYER = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
               "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}    # the norms: qwen3's
GEMMA_LAYER = {**LLAMA_LAYER, "post_attention_norm": "post_attention_layernorm",
               "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
PHI3_LAYER = {**LLAMA_LAYER, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}   # fused, as in HF
GPT2_TOP = {"token_embd.weight": "transformer.wte.weight", "position_embd.weight": "transformer.wpe.weight",
            "output_norm.weight": "transformer.ln_f.weight", "output_norm.bias": "transformer.ln_f.bias",
            "output.weight": "lm_head.weight"}
GPT2_LAYER = {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj", "ffn_norm": "ln_2",
              "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}
LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
# The "{arch}." keys that are sizes: at least 1, and each checked against the tensors the file holds
SIZES = ("context_length", "embedding_length", "feed_forward_length", "block_count", "attention.head_count",
         "attention.head_count_kv", "attention.key_length", "attention.value_length", "vocab_size")


def llama_rope_unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp interleaved rows -> HF rotate-half rows, per head: ``(heads*d, ...)`` -> same shape."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def refuse_key(path: Path, key: str, value, why: str) -> CheckpointError:
    return CheckpointError(f"{path}: GGUF metadata {key}={value!r} cannot be honoured: {why}")


def architecture(f: GGUFFile) -> str:
    arch = f.field("general.architecture")
    if arch not in ARCHITECTURES:
        raise refuse_key(f.path, "general.architecture", arch, f"tformer imports {', '.join(ARCHITECTURES)} only.")
    return arch


def check_metadata(f: GGUFFile, arch: str) -> None:
    """Refuse any ``{arch}.*`` key tformer does not know and the known ones it cannot implement."""
    for key, value in f.metadata.items():
        if key.startswith(arch + ".") and key[len(arch) + 1:] not in KNOWN_KEYS[arch]:
            raise refuse_key(f.path, key, value, "tformer does not implement what this key describes.")
    if arch != "gpt2":
        check_rope(f, arch)
    if f.field(f"{arch}.expert_count", 0):
        raise refuse_key(f.path, f"{arch}.expert_count", f.field(f"{arch}.expert_count"),
                         "mixture-of-experts layers are not implemented.")
    for key in (f"{arch}.attention.head_count", f"{arch}.attention.head_count_kv"):
        if isinstance(f.field(key), list):
            raise refuse_key(f.path, key, f.field(key)[:4], "a different head count per layer is not implemented.")


def hf_config(f: GGUFFile, arch: str) -> dict:
    """The HF ``config.json`` dict the file's metadata describes."""
    def need(key):
        value = f.field(f"{arch}.{key}")
        if value is None:
            raise CheckpointError(f"{f.path}: GGUF metadata {arch}.{key} is missing; a {arch} file must have it; "
                                  f"convert the model again with llama.cpp.")
        return value

    for key in SIZES:                       # the optional ones too, before anything divides by them
        value = f.field(f"{arch}.{key}")
        if isinstance(value, int) and value < 1:
            raise refuse_key(f.path, f"{arch}.{key}", value, "a size must be at least 1; the file is damaged.")

    vocab = f.tensors["token_embd.weight"].shape[0] if "token_embd.weight" in f.tensors else need("vocab_size")
    tied = "output.weight" not in f.tensors
    if arch == "gpt2":
        return {"model_type": "gpt2", "vocab_size": vocab, "n_positions": need("context_length"),
                "n_embd": need("embedding_length"), "n_layer": need("block_count"),
                "n_head": need("attention.head_count"), "n_inner": need("feed_forward_length"),
                "activation_function": "gelu_new", "layer_norm_epsilon": need("attention.layer_norm_epsilon"),
                "tie_word_embeddings": tied}
    d, heads = need("embedding_length"), need("attention.head_count")
    head_dim = f.field(f"{arch}.attention.key_length", d // heads)
    if f.field(f"{arch}.attention.value_length", head_dim) != head_dim:
        raise refuse_key(f.path, f"{arch}.attention.value_length", f.field(f"{arch}.attention.value_length"),
                         f"tformer needs values as wide as keys ({head_dim}).")
    rot = f.field(f"{arch}.rope.dimension_count", head_dim)
    if rot != head_dim:
        raise refuse_key(f.path, f"{arch}.rope.dimension_count", rot,
                         f"tformer rotates the whole head ({head_dim} dimensions).")
    bias = "blk.0.attn_q.bias" in f.tensors
    hf = {"model_type": arch, "vocab_size": vocab, "hidden_size": d, "intermediate_size": need("feed_forward_length"),
          "num_hidden_layers": need("block_count"), "num_attention_heads": heads,
          "num_key_value_heads": f.field(f"{arch}.attention.head_count_kv", heads), "head_dim": head_dim,
          "max_position_embeddings": need("context_length"), "hidden_act": "silu",
          "rms_norm_eps": need("attention.layer_norm_rms_epsilon"),
          "rope_theta": float(f.field(f"{arch}.rope.freq_base", 10000.0)), "tie_word_embeddings": tied}
    if arch in ("llama", "qwen3"):
        hf.update(attention_bias=bias, mlp_bias="blk.0.ffn_up.bias" in f.tensors)
    if arch in GEMMA_PATTERN:
        hf.update(gemma_config(f, arch, hf))
    if arch == "phi3":                        # 0: convert_hf_to_gguf.py's "no window"; the LongRoPE: gguf_rope
        hf.update(sliding_window=f.field(f"{arch}.attention.sliding_window") or None)
    return hf


def gemma_config(f: GGUFFile, arch: str, hf: dict) -> dict:
    """Gemma's HF fields as llama.cpp reads the file: the layer kinds and the gemma3 local base it fixes, the
    score scale by its rule (head_dim's, or (d / heads)'s at 27B), the window and the soft-caps."""
    layers, pattern = hf["num_hidden_layers"], GEMMA_PATTERN[arch]
    window = f.field(f"{arch}.attention.sliding_window")
    scalar = hf["hidden_size"] // hf["num_attention_heads"] if layers == GEMMA_27B_LAYERS[arch] else hf["head_dim"]
    out = {"model_type": ARCH_MODEL_TYPES.get(arch, arch), "hidden_activation": "gelu_pytorch_tanh",
           "query_pre_attn_scalar": scalar, "sliding_window": window,
           "layer_types": [("sliding_attention" if window and (i + 1) % pattern else "full_attention")
                           for i in range(layers)],
           "attn_logit_softcapping": f.field(f"{arch}.attn_logit_softcapping"),
           "final_logit_softcapping": f.field(f"{arch}.final_logit_softcapping")}
    if arch == "gemma3":
        out["rope_local_base_freq"] = 10000.0
    return out


def check_sizes(f: GGUFFile, arch: str, hf: dict) -> None:
    """Every size in the metadata agrees with the tensors the file holds, before any model is built: a
    370 KB file saying ``block_count = 10**9`` (or a feed-forward width of 2**40) must not allocate the
    model it describes. Refuses naming the key, its value and the tensor that contradicts it."""
    t = f.tensors
    layers = sorted({int(m.group(1)) for m in map(LAYER_NAME.match, t) if m})

    def agree(key, value, tensor, axis, expected):
        if tensor in t and (len(t[tensor].shape) <= axis or t[tensor].shape[axis] != expected):
            raise refuse_key(f.path, f"{arch}.{key}", value, f"tensor {tensor} has shape {list(t[tensor].shape)}, "
                             f"which does not fit it; the file is damaged.")

    blocks = f.field(f"{arch}.block_count")
    if len(layers) != blocks or (layers and layers[-1] != blocks - 1):
        raise refuse_key(f.path, f"{arch}.block_count", blocks, f"the file holds the tensors of {len(layers)} "
                         f"(numbered {layers[0] if layers else '-'} to {layers[-1] if layers else '-'}); the file is "
                         f"damaged.")
    if "token_embd.weight" not in t:
        raise CheckpointError(f"{f.path}: tensor token_embd.weight (the token embedding) is missing; the file is "
                              f"damaged.")
    vocab = f.field(f"{arch}.vocab_size")
    if vocab is not None and vocab != t["token_embd.weight"].shape[0]:
        raise refuse_key(f.path, f"{arch}.vocab_size", vocab, f"tensor token_embd.weight has "
                         f"{t['token_embd.weight'].shape[0]} rows; the file is damaged.")
    d = f.field(f"{arch}.embedding_length")
    agree("embedding_length", d, "token_embd.weight", 1, d)
    ff = f.field(f"{arch}.feed_forward_length")
    agree("feed_forward_length", ff, "blk.0.ffn_up.weight", 0, 2 * ff if arch == "phi3" else ff)   # phi3: gate, up
    if arch == "gpt2":
        agree("context_length", hf["n_positions"], "position_embd.weight", 0, hf["n_positions"])
        if d % hf["n_head"]:
            raise refuse_key(f.path, f"{arch}.attention.head_count", hf["n_head"], f"it does not divide "
                             f"embedding_length={d}.")
        return
    heads, kv_heads, head_dim = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    if heads % kv_heads:
        raise refuse_key(f.path, f"{arch}.attention.head_count_kv", kv_heads, f"it does not divide "
                         f"attention.head_count={heads}.")
    agree("attention.head_count", heads, "blk.0.attn_q.weight", 0, heads * head_dim)
    agree("attention.head_count_kv", kv_heads, "blk.0.attn_k.weight", 0, kv_heads * head_dim)
    agree("attention.head_count", heads, "blk.0.attn_qkv.weight", 0, (heads + 2 * kv_heads) * head_dim)


def check_finite(f: GGUFFile, name: str, a: np.ndarray, kept: bool) -> None:
    """Refuse a weight holding NaN or infinity (every later command refuses the checkpoint it would make):
    a float tensor's values, or a block-quantised one's f16 scales.

    A scale is read as its 16 bits (no float16 arithmetic, which numpy emulates): an f16 is infinite or NaN
    when its five exponent bits are all ones, so ``bits | 0x83FF`` (every other bit set) is 0xFFFF exactly
    for those, and one maximum finds them. The scales are gathered by one strided pass (both factors of a
    block at once, as one uint32, where they are adjacent and aligned) into a compact copy, which the
    maximum then reads: the file's blocks are read once."""
    if kept:
        fmt = KEPT[f.tensors[name].type]
        flat = np.ascontiguousarray(a).reshape(-1)                                 # (blocks · BYTES,) uint8
        size = kblocks.maths(fmt).BYTES[fmt]                                       # every format's block is even
        at = SCALE_BYTES.get(fmt, slice(0, 2))
        if at.stop - at.start == 4 and size % 4 == 0 and at.start % 4 == 0:       # d and m as one uint32
            bits = [np.bitwise_or(flat.view(np.uint32)[at.start // 4::size // 4], 0x83FF83FF).view(np.uint16)]
        else:
            bits = [np.bitwise_or(flat.view(np.uint16)[j::size // 2], 0x83FF) for j in range(at.start // 2, at.stop // 2)]
        if all(b.max() < 0xFFFF for b in bits):
            return
        bad = np.concatenate([b == 0xFFFF for b in bits])
    else:
        bad = ~np.isfinite(a)
    if bad.any():
        raise CheckpointError(f"{f.path}: tensor {name} holds {int(bad.sum()):,} NaN or infinite "
                              f"{'block scales' if kept else 'values'}; a model with them computes nothing; the file "
                              f"is damaged; download it again.")


def hf_name(f: GGUFFile, arch: str, name: str) -> str:
    """The HF name of llama.cpp's tensor ``name`` (refused if it has none)."""
    top, layer, prefix = (GPT2_TOP, GPT2_LAYER, "transformer.h.") if arch == "gpt2" else \
        (LLAMA_TOP, GEMMA_LAYER if arch in GEMMA_PATTERN else PHI3_LAYER if arch == "phi3" else LLAMA_LAYER, "model.layers.")
    if name in top:
        return top[name]
    m = LAYER_NAME.match(name)
    if m and m.group(2) in layer:
        return f"{prefix}{m.group(1)}.{layer[m.group(2)]}.{m.group(3)}"
    raise CheckpointError(f"{f.path}: tensor {name!r} is not part of a {arch} model as tformer implements it; "
                          f"tformer refuses to drop a weight it does not understand.")


# GGUF type -> tformer block format kept as stored
KEPT = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1", "Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k",
        "Q5_0": "q5_0", "Q5_1": "q5_1"}
SCALE_BYTES = {"q4_1": slice(0, 4), "q5_1": slice(0, 4), "q4_k": slice(0, 4), "q5_k": slice(0, 4),
               "q6_k": slice(208, 210)}   # the fp16 factors of a block (d alone: its first two bytes)
# tformer state name (under blocks.{i}.) -> the llama.cpp tensors it is made of (under blk.{i}.), in row order
GGUF_PARTS = {"attn.qkv_proj.weight": ("attn_q", "attn_k", "attn_v"), "attn.out_proj.weight": ("attn_output",),
              "ffn.gate.weight": ("ffn_gate",), "ffn.up.weight": ("ffn_up",), "ffn.down.weight": ("ffn_down",)}
# phi3: q, k, v one tensor; gate and up the two halves of ffn_up's rows
PHI3_PARTS = {**GGUF_PARTS, "attn.qkv_proj.weight": ("attn_qkv",), "ffn.gate.weight": ("ffn_up",)}
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")   # gguf_rope's


def hf_tensors(f: GGUFFile, arch: str, hf: dict, keep_quant: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor under its HF name, float32, in HF's layout; with ``keep_quant`` the Q8_0 / Q4_0 /
    Q4_1 matrices are their file bytes instead, ``(rows, row bytes)`` uint8."""
    out = {}
    for name in f.tensors:
        if name in ROPE_TENSORS:                     # the RoPE's divisors: config.rope_scaling (gguf_rope)
            continue
        target = hf_name(f, arch, name)
        kept = keep_quant and f.tensors[name].type in KEPT and len(f.tensors[name].shape) == 2 and \
            (".self_attn." not in target or target.endswith(("o_proj.weight", "qkv_proj.weight")) or
             qkv_types(f, name) <= set(KEPT))
        if kept and arch == "gpt2" and target.endswith(CONV1D):
            raise CheckpointError(f"{f.path}: keep_quant cannot keep {name} ({f.tensors[name].type}) as blocks: a gpt2 "
                                  f"file's matrices must be transposed for tformer; load it with keep_quant=False.")
        a = stored = f.blocks(name) if kept else f.array(name)
        check_finite(f, name, a, kept)
        if arch == "llama" and ".self_attn.q_proj." in target:
            a = llama_rope_unpermute(a, hf["num_attention_heads"])
        elif arch == "llama" and ".self_attn.k_proj." in target:
            a = llama_rope_unpermute(a, hf["num_key_value_heads"])
        elif arch == "gpt2" and target.endswith(CONV1D):
            a = a.T                                         # (out, in) -> Conv1D's (in, out)
        elif arch in GEMMA_PATTERN and name.endswith("norm.weight"):
            a = a - 1                                       # convert_hf_to_gguf.py stored Gemma's gains as 1 + w
        # kept blocks stay the mapped file's pages (copy-on-write: nothing reaches the file); floats are fresh arrays
        out[target] = torch.from_numpy(np.ascontiguousarray(a, dtype=np.uint8 if kept else np.float32))
        if kept and out[target].data_ptr() != stored.ctypes.data:   # a copy (RoPE's rows): the pages it read go back
            pages.release(torch.from_numpy(stored))
    return out


def split_qkv_rows(tensors: dict[str, torch.Tensor], n_layers: int, prefix: str) -> dict[str, list[torch.Tensor]]:
    """Take each layer's q, k and v kept as blocks out of ``tensors`` (HF names) and leave zero-width stand-ins
    ``(rows, 0)`` in their place, so that the family's converter joins their rows only (no copy of the bytes);
    returns state name (``blocks.{i}.attn.qkv_proj.weight``) -> the three, for :func:`install_blocks`."""
    out = {}
    for i in range(n_layers):
        names = [f"{prefix}layers.{i}.self_attn.{p}_proj.weight" for p in "qkv"]
        if all(n in tensors and tensors[n].dtype == torch.uint8 for n in names):
            out[f"blocks.{i}.attn.qkv_proj.weight"] = [tensors[n] for n in names]
            tensors.update({n: tensors[n][:, :0] for n in names})
    return out


def qkv_types(f: GGUFFile, name: str) -> set[str]:
    """The storage types of the q, k and v tensors of the layer of ``name`` (``blk.{i}.*``)."""
    layer = name.split(".")[1]
    return {f.tensors[f"blk.{layer}.{p}.weight"].type for p in GGUF_PARTS["attn.qkv_proj.weight"]}


def kept_parts(f: GGUFFile, key: str) -> list[tuple[int, str]]:
    """``(rows, block format)`` of each file tensor that tformer state ``key`` is made of, in row order."""
    m = re.fullmatch(r"blocks\.(\d+)\.(.+)", key)
    phi3 = f.field("general.architecture") == "phi3"
    names = ([f"blk.{m.group(1)}.{p}.weight" for p in (PHI3_PARTS if phi3 else GGUF_PARTS)[m.group(2)]] if m else
             ["output.weight" if key == "lm_head.weight" and "output.weight" in f.tensors else "token_embd.weight"])
    half = 2 if phi3 and m and m.group(2) in ("ffn.gate.weight", "ffn.up.weight") else 1     # a half of ffn_up
    return [(f.tensors[n].shape[0] // half, KEPT[f.tensors[n].type]) for n in names]


def load_gguf(path: str | Path, keep_quant: bool = False) -> torch.nn.Module:
    """Load a GGUF file as a :class:`~tformer.models.decoder.DecoderLM` in eval mode: float32, or with
    ``keep_quant`` its Q8_0 / Q4_0 / Q4_1 matrices kept as blocks (see the module docstring).

    Raises:
        CheckpointError: a malformed file, or an architecture, tensor type or metadata key that tformer
            cannot honour (one sentence naming it).
    """
    return load_gguf_file(GGUFFile(path), keep_quant=keep_quant)


def layer_formats(f: GGUFFile) -> set[str]:
    """The storage types of the file's layer matrices (``blk.*`` tensors of two dimensions): tformer's
    block format names where it keeps them (``q4_1``), else the GGUF type (``Q6_K``, ``F16``)."""
    return {KEPT.get(t.type, t.type) for name, t in f.tensors.items() if name.startswith("blk.") and len(t.shape) == 2}


def install_blocks(model: torch.nn.Module, kept: dict[str, torch.Tensor], f: GGUFFile,
                   qkv_rows: dict[str, list[torch.Tensor]] | None = None) -> None:
    """Replace the modules whose ``weight`` is in ``kept`` (state name -> file bytes) by block modules:
    ``nn.Linear`` -> BlockLinear, ``nn.Embedding`` -> BlockEmbedding; one buffer for tied matrices. A
    ``qkv_proj`` whose q, k and v are in ``qkv_rows`` (:func:`split_qkv_rows`) keeps the three as they are
    (views of the file, never joined into a copy): a JoinedLinear where they share a format, else a
    StackedLinear of three BlockLinears."""
    from tformer.quant.block_embedding import BlockEmbedding
    from tformer.quant.block_linear import BlockLinear, JoinedLinear, StackedLinear

    for key, packed in kept.items():
        path, _, leaf = key.rpartition(".")
        parent_name, _, child_name = path.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        child = getattr(parent, child_name)
        if leaf != "weight" or not isinstance(child, (torch.nn.Linear, torch.nn.Embedding)):
            raise CheckpointError(f"tensor {key} is block-quantised but belongs to a {type(child).__name__}, which "
                                  f"tformer runs in float only; load the file with keep_quant=False.")
        parts = kept_parts(f, key)
        rows = child.num_embeddings if isinstance(child, torch.nn.Embedding) else child.out_features
        if sum(r for r, _ in parts) != rows or (packed.dim() == 2 and packed.shape[0] != rows):
            raise CheckpointError(f"tensor {key} has {packed.shape[0]} rows but the metadata gives {rows}; the file "
                                  f"is damaged.")
        if isinstance(child, torch.nn.Embedding):
            setattr(parent, child_name, BlockEmbedding(packed, parts[0][1]))
            continue
        bias = child.bias.detach() if child.bias is not None else None
        rows = (qkv_rows or {}).get(key)
        if rows is None:
            setattr(parent, child_name, BlockLinear(packed, parts[0][1], bias))
        elif len({fmt for _, fmt in parts}) == 1:
            setattr(parent, child_name, JoinedLinear(rows, parts[0][1], bias))
        else:
            ends = np.cumsum([0] + [n for n, _ in parts])
            setattr(parent, child_name, StackedLinear([
                BlockLinear(r, fmt, None if bias is None else bias[a:e])
                for r, (_, fmt), a, e in zip(rows, parts, ends[:-1], ends[1:])]))


def load_gguf_file(f: GGUFFile, keep_quant: bool = False) -> torch.nn.Module:
    from tformer.interop.hf import build_model, family
    from tformer.nn.embedding import skip_init

    arch = architecture(f)
    check_metadata(f, arch)
    hf = hf_config(f, arch)
    check_sizes(f, arch, hf)
    module = family(hf["model_type"], "general.architecture")
    config = module.config_from_hf(hf)
    if arch != "gpt2":
        config = dataclasses.replace(config, rope_scaling=rope_scaling(f, arch, config))
    config.hf_model_type = hf["model_type"]
    tensors = hf_tensors(f, arch, hf, keep_quant)
    qkv_rows = split_qkv_rows(tensors, config.n_layers, module.PREFIX)
    src = TensorSource(tensors, prefix=module.PREFIX)
    state = module.state_from_hf(src, config)
    src.check_consumed()
    with skip_init():                                # every weight is loaded below (strictly)
        model = build_model(config, state)
    kept = {k: v for k, v in state.items() if v.dtype == torch.uint8}
    try:
        if kept:
            # biases and norms load into the float modules first; then the block modules replace theirs
            missing, unexpected = model.load_state_dict({k: v for k, v in state.items() if k not in kept}, strict=False)
            if set(missing) != set(kept) or unexpected:
                raise RuntimeError(f"size mismatch: missing {sorted(set(missing) - set(kept))[:3]}, "
                                   f"unexpected {unexpected[:3]}")
            install_blocks(model, kept, f, qkv_rows)
        else:
            model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        lines = [line.strip() for line in str(e).splitlines() if "size mismatch" in line]
        raise CheckpointError(f"{f.path}: the tensors do not fit the metadata ({(lines or [str(e)])[0]}); the "
                              f"file is damaged.") from e
    return model.eval()


def gguf_tokenizer(f: GGUFFile):
    """The file's tokenizer as a :class:`~tformer.tokenizers.HFTokenizer`, or ``None`` when the file has none
    (``tokenizer.ggml.model = none``): byte-level BPE (``gpt2``: SmolLM2, Llama 3, Qwen) split by the
    file's ``tokenizer.ggml.pre``, or SentencePiece-style (``llama``: Llama 2, Gemma, Phi-3; see
    :mod:`tformer.spm`), tokenizing as llama.cpp does."""
    from tformer.spm import gguf_spm_tokenizer
    from tformer.tokenizers import gguf_bpe_tokenizer

    kind = f.field("tokenizer.ggml.model", "none")
    if kind == "none":
        return None
    if kind not in ("gpt2", "llama"):
        raise refuse_key(f.path, "tokenizer.ggml.model", kind, "tformer reads byte-level BPE ('gpt2') and "
                         "SentencePiece-style ('llama') vocabularies only; load the weights with load_gguf and bring "
                         "the tokenizer separately.")
    tokens = f.field("tokenizer.ggml.tokens")
    ids = {k: f.field(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos")}
    types, name = f.field("tokenizer.ggml.token_type"), f.field("general.name")
    try:
        if kind == "gpt2":
            tok = gguf_bpe_tokenizer(
                tokens=tokens, merges=f.field("tokenizer.ggml.merges", []),
                token_types=types, pre=f.field("tokenizer.ggml.pre", "default"),
                bos_id=ids["bos"], add_bos=bool(f.field("tokenizer.ggml.add_bos_token", False)),
                eos_id=ids["eos"], add_eos=bool(f.field("tokenizer.ggml.add_eos_token", False)), name=name)
        else:                                   # llama.cpp adds BOS to these unless the file says not to
            tok = gguf_spm_tokenizer(
                tokens, f.field("tokenizer.ggml.scores"), types,
                add_space_prefix=bool(f.field("tokenizer.ggml.add_space_prefix", True)),
                bos_id=ids["bos"], eos_id=ids["eos"], unk_id=f.field("tokenizer.ggml.unknown_token_id"),
                add_bos=bool(f.field("tokenizer.ggml.add_bos_token", True)),
                add_eos=bool(f.field("tokenizer.ggml.add_eos_token", False)), name=name)
    except CheckpointError as e:
        raise CheckpointError(f"{f.path}: {e}") from None
    for key in ("eot_token_id", "padding_token_id", "unknown_token_id"):
        i = f.field(f"tokenizer.ggml.{key}")
        if i is not None and not 0 <= i < len(tokens):
            raise refuse_key(f.path, f"tokenizer.ggml.{key}", i, f"it is not the id of one of the {len(tokens)} "
                             f"tokens; the file is damaged.")
    embedding = f.tensors.get("token_embd.weight")
    if embedding is not None and len(tokens) > embedding.shape[0]:
        raise CheckpointError(f"{f.path}: the vocabulary (tokenizer.ggml.tokens) has {len(tokens)} tokens but tensor "
                              f"token_embd.weight only {embedding.shape[0]} rows, so the last ids have no embedding; "
                              f"the file is damaged.")
    return tok


def tokenizer_config(f: GGUFFile) -> dict:
    """HF ``tokenizer_config.json`` fields: the chat template and the special tokens by name."""
    tokens = f.field("tokenizer.ggml.tokens") or []
    spm = f.field("tokenizer.ggml.model") == "llama"            # llama.cpp's default differs by kind
    out = {"add_bos_token": bool(f.field("tokenizer.ggml.add_bos_token", spm))}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("pad_token", "padding_token_id"),
                      ("unk_token", "unknown_token_id")):
        i = f.field(f"tokenizer.ggml.{key}")
        if i is not None and 0 <= i < len(tokens):
            out[name] = tokens[i]
    if f.field("tokenizer.chat_template") is not None:
        out["chat_template"] = f.field("tokenizer.chat_template")
    return out


def stop_token_ids(f: GGUFFile) -> list[int]:
    """End-of-turn ids: ``eos`` and ``eot`` (llama.cpp stops at either)."""
    ids = [f.field(f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id")]
    return sorted({int(i) for i in ids if i is not None})


def convert_gguf(path: str | Path, out: str | Path) -> dict:
    """Write the checkpoint folder ``out`` (model, ``tokenizer.json``, ``tokenizer_config.json`` with the
    chat template, end-of-sequence ids) for GGUF file ``path``; ``out`` must be new or empty.

    Returns ``{"model", "tokenizer" (bool), "chat_template" (bool), "eos"}``.
    """
    from tformer.checkpoint import save_model
    from tformer.io import atomic_write, atomic_write_json

    f = GGUFFile(path)
    model = load_gguf_file(f)
    tok = gguf_tokenizer(f)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    eos = stop_token_ids(f)
    save_model(out, model, generation={"eos_token_id": eos} if eos else None)
    if tok is not None:
        atomic_write(out / "tokenizer.json", lambda tmp: tok.tok.save(tmp))
        atomic_write_json(out / "tokenizer_config.json", tokenizer_config(f))
    return {"model": model, "tokenizer": tok is not None, "chat_template": "tokenizer.chat_template" in f.metadata,
            "eos": eos}
