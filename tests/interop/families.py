"""Shared fixtures of the model families, made without downloads.

Each family is built by transformers from its own config class at the published configuration
(:data:`PUBLISHED`, copied from the models' ``config.json`` on the Hub), depth cut to 2 layers and the
vocabulary cut to this file's byte-level BPE (:func:`tokenizer`, trained here on :mod:`varied_text`, with
the special tokens the families' chat formats use; text split as the family's published tokenizer splits
it: ``llama-bpe`` for Llama 3, ``qwen2`` for Qwen), with random weights (every norm gain too, so that a
swapped or dropped gain shows). :func:`write_gguf` writes a GGUF file from those HF weights with the
``gguf`` package alone, as llama.cpp's ``convert_hf_to_gguf.py`` lays them out (not with tformer's
exporter, which would check tformer against itself); block formats are quantised by gguf-py's quantiser.

:func:`float64_angles` makes a transformers model compute its RoPE angles in float64 from transformers'
own frequency formula (it computes them in float32, whose error grows with the position), the reference
past a few hundred positions; for LongRoPE with its per-call choice of the long set past the original context. Part 2's families add an entry to :data:`PUBLISHED` and, where their GGUF
layout differs, a branch in :func:`write_gguf`.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import torch

from trained_vocabs import phi_pieces, phi_tokenizer_json
from varied_text import varied_lines

sys.path.append(str(Path(__file__).resolve().parents[1]))     # tests/, for gguf_hf
from gguf_hf import add_llama_hyperparameters, finish  # noqa: E402

N_LAYERS = 2
SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>",
           "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SPECIAL += ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"]                          # Gemma's
SPECIAL += ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]                     # Phi-3's chat format
VOCAB = 640

# The families' chat formats, written here from their published layout (Llama 3's headers, Qwen's ChatML).
LLAMA3_CHAT = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
               "{{ m['content'] }}<|eot_id|>{% endfor %}"
               "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
GEMMA_CHAT = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else "
              "m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
              "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
TEMPLATES = {"llama": LLAMA3_CHAT, "qwen2": CHATML, "qwen3": CHATML, "gemma2": GEMMA_CHAT, "gemma3": GEMMA_CHAT}
TEMPLATES["phi3"] = ("{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '<|end|>\\n' }}{% endfor %}"
                     "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}")
# tokenizer.ggml.pre of the published files (Gemma publishes a SentencePiece vocabulary: GPT-2's split here; Phi-3.5's
# fixture has its SentencePiece kind, trained_vocabs.phi_pieces, which has no pre-tokenizer)
PRE = {"llama": "llama-bpe", "qwen2": "qwen2", "qwen3": "qwen2", "gemma2": "gpt-2", "gemma3": "gpt-2"}
PHI_VOCAB = 3072             # Phi-3.5's fixture: 3,000 pieces, 8 unused, its 11 added tokens, padding (as 32,064)
# The Split pattern of the published tokenizer.json files (Llama 3's and Qwen2's), before ByteLevel
SPLITS = {
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                 r"|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
             r"|\s+(?!\S)|\s+",
}
# Qwen3's layout with tools, written here from the published template's behaviour: the functions' JSON
# signatures in a <tools> block of the system turn, an earlier call as <tool_call>{"name", "arguments"}</tool_call>,
# consecutive tool results as <tool_response> blocks in one user turn, enable_thinking=False as an empty <think>.
QWEN3_TOOLS_CHAT = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
    {{- '# Tools\n\nThe functions you may call, as JSON signatures inside <tools></tools>:\n<tools>' }}
    {%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
    {{- '\n</tools>\n\nTo call one, answer with its name and arguments as a JSON object inside <tool_call></tool_call> '
       'tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for m in messages %}
    {%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}
    {%- elif m.role == 'assistant' %}
        {{- '<|im_start|>assistant\n' + (m.content or '') }}
        {%- for call in m.tool_calls or [] %}
            {%- if m.content or not loop.first %}{{- '\n' }}{%- endif %}
            {%- set fn = call.function if call.function else call %}
            {{- '<tool_call>\n{"name": "' + fn.name + '", "arguments": ' }}
            {%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif m.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' + m.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}
"""

# family -> (transformers config class, GGUF architecture, published config fields, (bos, eos, eot) tokens)
LLAMA3 = dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=8192)
# What Gemma-3-270M and 1B share (google/gemma-3-270m, google/gemma-3-1b-it); their cut keeps a local and a global
# layer (layer_types); in a GGUF file llama.cpp makes every sixth layer global whatever the config says, so the GGUF
# fixtures take the default kinds (gguf_layout)
GEMMA3 = dict(num_key_value_heads=1, head_dim=256, max_position_embeddings=32768, rms_norm_eps=1e-6,
              rope_theta=1000000.0, rope_local_base_freq=10000.0, tie_word_embeddings=True,
              hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256, sliding_window=512,
              attention_bias=False, layer_types=["sliding_attention", "full_attention"])
PUBLISHED = {
    "llama-3.2-1b": ("LlamaConfig", "llama", dict(   # meta-llama/Llama-3.2-1B
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=LLAMA3,
        tie_word_embeddings=True, attention_bias=False, mlp_bias=False),
        ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>")),
    "llama-3.1-8b": ("LlamaConfig", "llama", dict(   # meta-llama/Llama-3.1-8B
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling={**LLAMA3, "factor": 8.0},
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False),
        ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>")),
    "qwen3-0.6b": ("Qwen3Config", "qwen3", dict(     # Qwen/Qwen3-0.6B
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
        attention_bias=False, use_sliding_window=False),
        (None, "<|im_end|>", "<|im_end|>")),
    "qwen2.5-0.5b-yarn": ("Qwen2Config", "qwen2", dict(   # Qwen/Qwen2.5-0.5B with its model card's YaRN (factor 4)
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        max_position_embeddings=131072, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
        use_sliding_window=False,
        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768)),
        (None, "<|endoftext|>", "<|im_end|>")),
    "gemma-2-2b": ("Gemma2Config", "gemma2", dict(    # google/gemma-2-2b (layers alternate local, global)
        hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
        head_dim=256, max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True,
        hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256, sliding_window=4096,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, attention_bias=False),
        ("<bos>", "<eos>", "<end_of_turn>")),
    "gemma-3-270m": ("Gemma3TextConfig", "gemma3", dict(   # google/gemma-3-270m
        hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4, **GEMMA3),
        ("<bos>", "<eos>", "<end_of_turn>")),
    "gemma-3-1b": ("Gemma3TextConfig", "gemma3", dict(     # google/gemma-3-1b-it
        hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4, **GEMMA3),
        ("<bos>", "<eos>", "<end_of_turn>")),
}
# microsoft/Phi-3.5-mini-instruct's LongRoPE divisors (config.json rope_scaling, float32 values as published)
PHI35_LONG = [1.0800000429153442, 1.1100000143051147, 1.1399999856948853, 1.340000033378601, 1.5899999141693115,
              1.600000023841858, 1.6200000047683716, 2.620000123977661, 3.2300000190734863, 3.2300000190734863,
              4.789999961853027, 7.400000095367432, 7.700000286102295, 9.09000015258789, 12.199999809265137,
              17.670000076293945, 24.46000099182129, 28.57000160217285, 30.420001983642578, 30.840002059936523,
              32.590003967285156, 32.93000411987305, 42.320003509521484, 44.96000289916992, 50.340003967285156,
              50.45000457763672, 57.55000305175781, 57.93000411987305, 58.21000289916992, 60.1400032043457,
              62.61000442504883, 62.62000274658203, 62.71000289916992, 63.1400032043457, 63.1400032043457,
              63.77000427246094, 63.93000411987305, 63.96000289916992, 63.970001220703125, 64.02999877929688,
              64.06999969482422, 64.08000183105469, 64.12000274658203, 64.41000366210938, 64.4800033569336,
              64.51000213623047, 64.52999877929688, 64.83999633789062]
PHI35_SHORT = [1.0, 1.0199999809265137, 1.0299999713897705, 1.0299999713897705, 1.0499999523162842,
               1.0499999523162842, 1.0499999523162842, 1.0499999523162842, 1.0499999523162842, 1.0699999332427979,
               1.0999999046325684, 1.1099998950958252, 1.1599998474121094, 1.1599998474121094, 1.1699998378753662,
               1.2899998426437378, 1.339999794960022, 1.679999828338623, 1.7899998426437378, 1.8199998140335083,
               1.8499997854232788, 1.8799997568130493, 1.9099997282028198, 1.9399996995925903, 1.9899996519088745,
               2.0199997425079346, 2.0199997425079346, 2.0199997425079346, 2.0199997425079346, 2.0199997425079346,
               2.0199997425079346, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914,
               2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914,
               2.0799996852874756, 2.0899996757507324, 2.189999580383301, 2.2199995517730713, 2.5899994373321533,
               2.729999542236328, 2.749999523162842, 2.8399994373321533]
PUBLISHED["phi-3.5-mini"] = ("Phi3Config", "phi3", dict(   # microsoft/Phi-3.5-mini-instruct
    hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
    max_position_embeddings=131072, original_max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
    rope_scaling=dict(type="longrope", long_factor=PHI35_LONG, short_factor=PHI35_SHORT), sliding_window=262144,
    tie_word_embeddings=False, attention_bias=False),
    (None, "<|endoftext|>", "<|end|>"))


def tokenizer(folder: Path) -> Path:
    """A byte-level BPE of :data:`VOCAB` tokens (GPT-2's split) trained on varied text, with :data:`SPECIAL`
    as added tokens, saved as ``folder/tokenizer.json``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = folder / "tokenizer.json"
    if path.is_file():
        return path
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(varied_lines(3000, seed=5) + ["hi there, hello! how are you?"] * 20, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def hf_config(family: str, gguf_layout: bool = False, layers: int | None = None, vocab_size: int | None = None):
    """transformers' config of ``family``: published, ``layers`` deep (default :data:`N_LAYERS`, read at the
    call: a test may patch it), this file's vocabulary (or ``vocab_size`` ids, the fixture's tokens first;
    Phi-3.5's: :data:`PHI_VOCAB` ids of its SentencePiece kind);
    ``gguf_layout``: the layer kinds llama.cpp gives a GGUF file of the architecture (the config's default ones)."""
    import transformers

    cls, _, fields, (bos, eos, _eot) = PUBLISHED[family]
    vocab_size = vocab_size or (PHI_VOCAB if cls == "Phi3Config" else VOCAB)
    ids = special_ids(family, vocab_size)
    fields = {**fields, "num_hidden_layers": layers or N_LAYERS, "vocab_size": vocab_size,
              "bos_token_id": ids.get(bos), "eos_token_id": ids[eos]}
    if gguf_layout:
        fields.pop("layer_types", None)
    if cls == "Phi3Config":
        fields["pad_token_id"] = ids[eos]                    # Phi-3's padding is its end of text
    return getattr(transformers, cls)(**fields)


_TOKENIZER_DIR: list[Path] = []


def tokenizer_json_text() -> str:
    """The fixture tokenizer's JSON (trained once per process, in a temporary folder)."""
    import tempfile

    if not _TOKENIZER_DIR:
        _TOKENIZER_DIR.append(Path(tempfile.mkdtemp(prefix="tformer-families-")))
    return tokenizer(_TOKENIZER_DIR[0]).read_text(encoding="utf-8")


def special_ids(family: str, vocab_size: int | None = None) -> dict[str, int]:
    """The ids of ``family``'s fixture vocabulary's added tokens by name: Phi-3.5's SentencePiece kind of
    ``vocab_size`` ids (:func:`trained_vocabs.phi_pieces`: its control tokens), else this file's BPE."""
    if PUBLISHED[family][1] == "phi3":
        tokens, _, types = phi_pieces(vocab_size or PHI_VOCAB)
        return {t: i for i, (t, k) in enumerate(zip(tokens, types)) if k == 3}
    return {a["content"]: a["id"] for a in json.loads(tokenizer_json_text())["added_tokens"]}


def special_id(token: str, family: str = "llama-3.2-1b") -> int:
    return special_ids(family)[token]


def hf_model(family: str, seed: int = 0, gguf_layout: bool = False):
    """The transformers model of ``family`` with random weights, every 1-D weight (norm gains) random around 1
    (Gemma's ``w`` of its ``1 + w`` around 0); ``gguf_layout`` as :func:`hf_config`."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family, gguf_layout), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_((0.0 if PUBLISHED[family][1].startswith("gemma") else 1.0) + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 0.05)               # sharper than the 0.02 init: greedy tokens far from ties
    return model.eval()


def hf_folder(family: str, folder: Path, seed: int = 0) -> Path:
    """``family``'s model saved by transformers (``save_pretrained``) with the fixture tokenizer."""
    if (folder / "config.json").is_file():
        return folder
    model = hf_model(family, seed)
    model.save_pretrained(folder)
    (folder / "tokenizer.json").write_text(family_tokenizer_json(family), encoding="utf-8")
    return folder


def family_tokenizer_json(family: str) -> str:
    """The fixture tokenizer splitting text as ``family``'s published tokenizer.json does (a ``Split`` by
    its pattern, then ``ByteLevel`` without its own regex): the vocabulary and merges are the fixture's."""
    from tokenizers import Regex, Tokenizer, pre_tokenizers

    if PUBLISHED[family][1] == "phi3":           # Phi-3.5's SentencePiece kind, laid out as its tokenizer.json
        return phi_tokenizer_json(PHI_VOCAB)
    pre = PRE[PUBLISHED[family][1]]
    if pre not in SPLITS:                       # GPT-2's own split: the trained tokenizer as it is
        return tokenizer_json_text()
    tok = Tokenizer.from_str(tokenizer_json_text())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLITS[pre]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return tok.to_str()


def float64_angles(model) -> None:
    """Make the transformers ``model``'s rotary embedding compute its angles in float64: its own frequency
    function evaluated with ``torch.float`` meaning float64, and positions times frequencies in float64
    (Gemma 3's, one table per layer kind: each kind's)."""
    rotary = model.model.rotary_emb
    if isinstance(rotary.rope_type, dict):
        return _float64_angles_per_kind(model)
    if rotary.rope_type == "default":
        fn = type(rotary).compute_default_rope_parameters
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        fn = ROPE_INIT_FUNCTIONS[rotary.rope_type]
    original = model.config.rope_parameters.get("original_max_position_embeddings")
    if rotary.rope_type == "longrope":      # its function writes .float(): float64 too; the long set past the original
        with mock.patch.object(torch, "float", torch.float64), \
                mock.patch.object(torch.Tensor, "float", lambda t, *a, **k: t.to(torch.float64)):
            inv_freq, scale = fn(model.config)
            long_freq = fn(model.config, seq_len=original + 1)[0].to(torch.float64)
    else:
        with mock.patch.object(torch, "float", torch.float64):
            inv_freq, scale = fn(model.config)
    inv_freq = inv_freq.to(torch.float64)

    def forward(x, position_ids):
        use = long_freq if rotary.rope_type == "longrope" and int(position_ids.max()) + 1 > original else inv_freq
        freqs = position_ids[..., None].to(torch.float64) * use                  # (B, T, hs/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * scale).to(x.dtype), (emb.sin() * scale).to(x.dtype)

    rotary.forward = forward


def _float64_angles_per_kind(model) -> None:
    """:func:`float64_angles` for a rotary embedding with a table per layer kind (Gemma 3: unscaled ones only)."""
    rotary = model.model.rotary_emb
    tables = {}
    for kind, rope_type in rotary.rope_type.items():
        assert rope_type == "default", rope_type
        with mock.patch.object(torch, "float", torch.float64):
            inv_freq, scale = type(rotary).compute_default_rope_parameters(model.config, layer_type=kind)
        tables[kind] = (inv_freq.to(torch.float64), scale)

    def forward(x, position_ids, layer_type):
        inv_freq, scale = tables[layer_type]
        freqs = position_ids[..., None].to(torch.float64) * inv_freq             # (B, T, hs/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * scale).to(x.dtype), (emb.sin() * scale).to(x.dtype)

    rotary.forward = forward


def rope_factors(model) -> np.ndarray:
    """Llama 3.1's scaling as the divisors llama.cpp reads from ``rope_freqs.weight``: plain frequencies over
    the scaled ones, both from transformers' own functions (float32, as convert_hf_to_gguf.py computes them)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    c = model.config
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](c)
    plain, _ = type(model.model.rotary_emb).compute_default_rope_parameters(c)
    return (plain / scaled).numpy().astype(np.float32)


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """HF rotate-half rows -> llama.cpp's interleaved rows (convert_hf_to_gguf.py's LlamaModel.permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(family: str, model, path: Path, kind: str = "f32", arrays=None) -> Path:
    """``model`` (``hf_model(family)``) as a GGUF file written with the ``gguf`` package: metadata, the
    fixture tokenizer (padded with unreachable tokens up to ``model.config.vocab_size``, as the full-size
    files need), and every tensor under llama.cpp's name (f32 1-D, ``kind`` for matrices: f32, f16, or
    q8_0 / q4_0 quantised by gguf-py). ``arrays(hf_name, tensor)`` gives each tensor's values (default: the
    tensor's own; :func:`full_size_gguf` passes random ones for a model built on the meta device)."""
    import gguf

    arrays = arrays or (lambda _name, t: t.detach().float().numpy())

    _, arch, _, (bos, eos, eot) = PUBLISHED[family]
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(family)
    add_llama_hyperparameters(w, c)
    w.add_rope_dimension_count(head_dim)
    if head_dim != c.hidden_size // c.num_attention_heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_vocab_size(c.vocab_size)
    w.add_file_type({"f32": 0, "f16": 1, "q8_0": 7, "q4_0": 2}[kind])
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)      # Gemma 3: the global layers'
    if arch.startswith("gemma"):                # convert_hf_to_gguf.py's Gemma2Model / Gemma3Model keys
        w.add_sliding_window(c.sliding_window)
        if c.attn_logit_softcapping is not None:
            w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        if c.final_logit_softcapping is not None:
            w.add_final_logit_softcapping(c.final_logit_softcapping)
    if rope["rope_type"] == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    elif rope["rope_type"] == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if arch == "phi3":         # Phi-3.5's SentencePiece vocabulary, as convert_hf_to_gguf.py writes it
        tokens, scores, types = phi_pieces(c.vocab_size)
        vocab = {t: i for i, t in enumerate(tokens)}
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_unk_token_id(0)
        w.add_add_space_prefix(True)
    else:
        tok = json.loads(tokenizer_json_text())
        vocab = {**tok["model"]["vocab"], **{a["content"]: a["id"] for a in tok["added_tokens"]}}
        tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
        tokens += [f"Ġ~fill{i}" for i in range(c.vocab_size - len(tokens))]   # no merge makes them: never produced
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(PRE[arch])
        w.add_token_list(tokens)
        w.add_token_types([3 if t in SPECIAL else 1 for t in tokens])
        w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    if bos:
        w.add_bos_token_id(vocab[bos])
    w.add_add_bos_token(bos is not None)
    w.add_eos_token_id(vocab[eos])
    w.add_eot_token_id(vocab[eot])
    w.add_chat_template(TEMPLATES[arch])
    if arch == "phi3":            # convert_hf_to_gguf.py's Phi3MiniModel: LongRoPE's divisors as tensors
        original = rope["original_max_position_embeddings"]
        scale = c.max_position_embeddings / original
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        w.add_sliding_window(c.sliding_window or 0)
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    names = gguf.TensorNameMap(gguf.MODEL_ARCH[arch.upper()], c.num_hidden_layers)
    if rope["rope_type"] == "llama3":
        w.add_tensor("rope_freqs.weight", rope_factors(model))
    for hf_name, t in model.state_dict().items():
        if c.tie_word_embeddings and hf_name == "lm_head.weight":
            continue
        a = arrays(hf_name, t)
        if arch.startswith("gemma") and hf_name.endswith("norm.weight"):
            a = a + 1                           # convert_hf_to_gguf.py stores Gemma's (1 + w) gains as 1 + w
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            a = permute(a, c.num_attention_heads)
        elif arch == "llama" and hf_name.endswith("k_proj.weight"):
            a = permute(a, c.num_key_value_heads)
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        if a.ndim < 2 or kind == "f32":
            w.add_tensor(name, a.astype(np.float32))
        elif kind == "f16":
            w.add_tensor(name, a.astype(np.float16))
        else:
            qt = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}[kind]
            w.add_tensor(name, gguf.quants.quantize(a, qt), raw_dtype=qt)
    finish(w)
    return path


FULL_VOCAB = {"llama-3.2-1b": 128256, "llama-3.1-8b": 128256, "qwen3-0.6b": 151936, "qwen2.5-0.5b-yarn": 151936,
              "phi-3.5-mini": 32064}
FULL_VOCAB.update({"gemma-2-2b": 256000, "gemma-3-270m": 262144, "gemma-3-1b": 262144})   # Gemma's SentencePiece sizes


def full_size_gguf(family: str, path: Path, seed: int = 0) -> Path:
    """``family`` at its published size (full depth, the published vocabulary size :data:`FULL_VOCAB`) as an
    f16 GGUF file with random weights, for speed benchmarks: the model is built by transformers on the meta
    device (names and shapes, no memory) and each tensor drawn as it is written (matrices N(0, 0.02), norm
    gains 1 + N(0, 0.2), biases N(0, 0.2)), so the peak is the f16 file's size, not a float32 model's."""
    import transformers

    # gguf_layout: the layer kinds llama.cpp gives the file (the fixture's two-layer list does not fit full depth)
    cfg = hf_config(family, gguf_layout=True, layers=PUBLISHED[family][2]["num_hidden_layers"],
                    vocab_size=FULL_VOCAB[family])
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    g = torch.Generator().manual_seed(seed)
    gemma = PUBLISHED[family][1].startswith("gemma")

    def draw(name: str, t: torch.Tensor) -> np.ndarray:
        x = torch.randn(t.shape, generator=g)
        if t.dim() == 2:
            return x.mul_(0.02).half().numpy()
        return (x.mul_(0.2) + (0 if name.endswith(".bias") or gemma else 1)).numpy()   # Gemma's w of its 1 + w

    return write_gguf(family, model, path, "f16", arrays=draw)


PROMPT_LENGTHS = (1, 7, 33, 120)


def prompts(seed: int = 0) -> list[list[int]]:
    """Four prompts of fixture ids (1 to 120 tokens)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB - len(SPECIAL) - 1, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def far_positions(original: int, n: int = 6) -> torch.Tensor:
    """Positions ``0..n-1`` then ``original + 1 ..``: a prompt whose last tokens attend across more than
    ``original`` positions (a scaled RoPE's slow frequencies, at no cost of a prompt that long)."""
    return torch.cat([torch.arange(n), torch.arange(original + 1, original + 1 + n)])


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over max |b|."""
    return float((a - b).abs().max() / b.abs().max())

