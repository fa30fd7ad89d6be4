"""One validated configuration for every architectural switch, plus named presets.

Every model in tformer is built from a :class:`TransformerConfig`. Changing the
architecture (positions, norms, heads, feed-forward, attention backend) means
changing a field here, never editing a model class.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from tformer.errors import ConfigError

POSITIONS = ("none", "learned", "sinusoidal", "rope", "alibi")
NORMS = ("layernorm", "rmsnorm")
NORM_PLACEMENTS = ("pre", "post")
FFN_KINDS = ("mlp", "swiglu", "geglu", "none")
ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu", "relu2")
BACKENDS = ("auto", "math", "torch", "flash", "short")


def _choice(name: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ConfigError(f"{name}={value!r} is not known; choose one of {', '.join(valid)}.")


@dataclass
class TransformerConfig:
    """All switches of a transformer. Unset derived fields (``None``) are filled in ``__post_init__``.

    Args:
        vocab_size: number of token ids.
        context_length: the longest sequence the model is built for (learned positions
            have exactly this many rows; RoPE/sinusoidal tables are precomputed to it).
        n_layers: number of blocks.
        d_model: width of the residual stream.
        n_heads: number of query heads.
        n_kv_heads: number of key/value heads; ``n_heads`` is MHA, 1 is MQA, in between is GQA.
            Defaults to ``n_heads``.
        head_dim: width of one head; defaults to ``d_model // n_heads``.
        d_ff: hidden width of the feed-forward; defaults to ``4 * d_model`` for ``mlp`` and to
            ``8/3 * d_model`` rounded up to ``ffn_multiple_of`` for ``swiglu`` (same parameters).
        positions: ``none``, ``learned``, ``sinusoidal`` (added to the embedding), ``rope``
            (rotates q and k) or ``alibi`` (a linear bias on the scores).
        rope_base: the base θ of the RoPE frequencies.
        rope_scaling: ``None`` (plain RoPE) or a dict scaling its frequencies for a longer context, keyed as
            transformers' ``rope_parameters`` (see :data:`ROPE_SCALINGS`): ``{"rope_type": "linear", "factor": 4}``
            (every frequency / factor), ``"llama3"`` (Llama 3.1: low frequencies / factor, high ones kept, a
            smooth ramp between; ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``),
            ``"yarn"`` (Peng et al. 2023: the same ramp by rotations per original context, ``beta_fast``,
            ``beta_slow``, and cos/sin times ``attention_factor``, default ``0.1·ln(factor) + 1``) or
            ``"factors"`` (``factors``: one divisor per frequency, head_dim/2 of them, as a GGUF
            ``rope_freqs.weight`` stores them). On the command line: ``--set 'rope_scaling={"rope_type": ...}'``.
        norm: ``layernorm`` or ``rmsnorm``; ``norm_eps`` its epsilon.
        norm_placement: ``pre`` (x + f(norm(x)), GPT-2/Llama) or ``post`` (norm(x + f(x)), Vaswani/BERT).
        ffn: ``mlp`` (Linear, activation, Linear), ``swiglu`` (gated, Llama), ``geglu`` (gated
            by ``activation``, GELU or its tanh form: Gemma) or ``none`` (no feed-forward sub-layer: the mixer
            is the whole layer, as in Mamba).
        activation: non-linearity of the ``mlp`` (``gelu`` is the exact erf form; ``relu2`` is
            ReLU(x)², So et al. 2021, the modded-nanogpt speedrun's).
        bias: biases on every Linear and norm.
        qkv_bias: biases on the q/k/v projections only (Qwen2); defaults to ``bias``.
        dropout: dropout on residual branches and embeddings; ``attn_dropout`` on attention weights.
        tie_embeddings: the LM head shares the token-embedding matrix.
        causal: decoder (True) or encoder (False) self-attention.
        attention_backend: ``auto``, ``math`` (explicit softmax), ``torch`` (PyTorch's fused
            kernel), ``flash`` (tformer's tiled kernel) or ``short`` (tformer's CPU kernel for short
            float32 sequences, which ``auto`` takes in training steps).
        sliding_window: if set, each query sees only the last ``sliding_window`` keys (Mistral).
        embedding_norm: a norm right after the (token + position + type) embedding sum
            (BERT's embeddings LayerNorm, BLOOM's word_embeddings_layernorm).
        type_vocab_size: number of token-type (segment) embeddings added to the input (BERT: 2);
            0 means none.
        init_std: standard deviation of the weight init (GPT-2: 0.02).
        model: the model family, a key of ``tformer.models.MODELS`` (``decoder``, ``encoder``, ...);
            defaults to ``decoder`` when ``causal`` else ``encoder``.
        mixer: the token mixer of every layer, a key of ``tformer.mixers.MIXERS`` (``attention``,
            ...), or a list of them repeated over the stack: ``["mamba", "mamba", "attention"]``
            puts attention in every third layer. Its length must divide ``n_layers``.
        mixer_options: per-mixer settings, ``{mixer name: {option: value}}``, checked by the mixer.
        encoder_layers: blocks in the encoder of an ``encoder-decoder`` model (``n_layers`` counts
            the decoder's); defaults to ``n_layers``.
        encoder_d_ff: the encoder's feed-forward width in an ``encoder-decoder`` model (``d_ff`` is
            the decoder's); defaults to ``d_ff`` (HF's ``encoder_ffn_dim`` / ``decoder_ffn_dim``).
        embedding_scale: multiply token embeddings by sqrt(d_model) before adding positions
            (Vaswani et al. §3.4, Marian; Gemma's decoder).
        qk_norm: RMS-normalise each head's q and k (no gain) before RoPE, so a score is at most
            ``head_dim · scale`` and the logits cannot grow without bound (Dehghani et al. 2023).
        qk_norm_gain: with ``qk_norm``, a learned gain of ``head_dim`` values shared by the heads (one for q,
            one for k) and ``norm_eps`` as the norm's epsilon: Qwen3's ``q_norm`` / ``k_norm``.
        zero_init_residual: initialise every projection that writes into the residual stream (attention's
            ``out_proj``, the feed-forward's ``down``) to zero, so each block starts as the identity.
        logit_softcap: ``cap · tanh(z / cap)`` on the LM head's logits (Gemma 2); 0 = off.
        norm_unit_offset: every RMSNorm (the QK-norm's too) multiplies by ``1 + w``, its weight ``w`` starting at
            zero (Gemma's storage of the gain).
        attn_scale: the factor on ``Q Kᵀ``; ``None`` = ``1/sqrt(head_dim)`` (Gemma: ``query_pre_attn_scalar^-1/2``).
        attn_softcap: ``cap · tanh(s / cap)`` on the attention scores before the mask and softmax (Gemma 2); 0 = off.
        post_norms: a norm on each sub-layer's output before the residual add, ``x + norm'(f(norm(x)))``: four
            norms per block (Gemma 2 and 3); needs ``norm_placement='pre'``.
        window_layers: which layers use ``sliding_window`` (the others attend globally), a list of booleans
            cycled over the stack: Gemma 2 ``[true, false]``, Gemma 3 five ``true`` then ``false``; ``None`` =
            every layer (when ``sliding_window`` is set).
        rope_local_base: the RoPE base of the sliding-window layers, unscaled (Gemma 3: 10,000 where the global
            layers use ``rope_base`` 1,000,000); ``None`` = every layer uses ``rope_base`` and ``rope_scaling``.
        hf_model_type: the HuggingFace ``model_type`` this config came from or exports to
            (``gpt2``, ``llama``, ...); ``name`` is the tformer preset, a separate thing.
    """

    vocab_size: int = 256
    context_length: int = 64
    n_layers: int = 4
    d_model: int = 128
    n_heads: int = 4
    n_kv_heads: int | None = None
    head_dim: int | None = None
    d_ff: int | None = None
    ffn_multiple_of: int = 64
    positions: str = "learned"
    rope_base: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    norm_placement: str = "pre"
    ffn: str = "mlp"
    activation: str = "gelu"
    bias: bool = True
    qkv_bias: bool | None = None
    dropout: float = 0.0
    attn_dropout: float = 0.0
    tie_embeddings: bool = True
    causal: bool = True
    attention_backend: str = "auto"
    sliding_window: int | None = None
    embedding_norm: bool = False
    type_vocab_size: int = 0
    init_std: float = 0.02
    model: str | None = None
    mixer: str | list[str] = "attention"
    mixer_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    encoder_layers: int | None = None
    encoder_d_ff: int | None = None
    embedding_scale: bool = False
    qk_norm: bool = False
    qk_norm_gain: bool = False
    zero_init_residual: bool = False
    logit_softcap: float = 0.0
    norm_unit_offset: bool = False
    attn_scale: float | None = None
    attn_softcap: float = 0.0
    post_norms: bool = False
    window_layers: list[bool] | None = None
    rope_local_base: float | None = None
    hf_model_type: str | None = None
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        for f in ("vocab_size", "context_length", "n_layers", "d_model", "n_heads"):
            value = getattr(self, f)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{f}={value!r} must be a positive integer.")
        _choice("positions", self.positions, POSITIONS)
        _choice("norm", self.norm, NORMS)
        _choice("norm_placement", self.norm_placement, NORM_PLACEMENTS)
        _choice("ffn", self.ffn, FFN_KINDS)
        _choice("activation", self.activation, ACTIVATIONS)
        _choice("attention_backend", self.attention_backend, BACKENDS)

        if self.head_dim is None:
            if self.d_model % self.n_heads != 0:
                raise ConfigError(
                    f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                    f"choose n_heads dividing d_model (e.g. {_divisors_hint(self.d_model)}) "
                    f"or set head_dim explicitly."
                )
            self.head_dim = self.d_model // self.n_heads
        elif self.head_dim < 1:
            raise ConfigError(f"head_dim={self.head_dim} must be a positive integer.")
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads != 0:
            raise ConfigError(
                f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}; "
                f"n_kv_heads must divide n_heads (n_heads for MHA, 1 for MQA, a divisor for GQA)."
            )
        if self.positions == "rope" and self.head_dim % 2 != 0:
            raise ConfigError(f"positions='rope' needs an even head_dim, got head_dim={self.head_dim}.")
        if self.positions == "sinusoidal" and self.d_model % 2 != 0:
            raise ConfigError(f"positions='sinusoidal' needs an even d_model, got d_model={self.d_model}.")
        if self.d_ff is None:
            if self.ffn == "mlp":
                self.d_ff = 4 * self.d_model
            elif self.ffn == "none":
                self.d_ff = 0
            else:
                hidden = int(2 * (4 * self.d_model) / 3)
                m = self.ffn_multiple_of
                self.d_ff = m * ((hidden + m - 1) // m)
        if self.qkv_bias is None:
            self.qkv_bias = self.bias
        for f in ("dropout", "attn_dropout"):
            p = getattr(self, f)
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
                raise ConfigError(f"{f}={p} must be in [0, 1).")
        if self.attention_backend == "flash" and self.attn_dropout > 0:
            raise ConfigError(f"attention_backend='flash' has no attention dropout (attn_dropout={self.attn_dropout}); "
                             f"set attn_dropout=0 or use attention_backend='auto' or 'torch'.")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ConfigError(f"sliding_window={self.sliding_window} must be a positive integer or None.")
        if isinstance(self.type_vocab_size, bool) or not isinstance(self.type_vocab_size, int) \
                or self.type_vocab_size < 0:
            raise ConfigError(f"type_vocab_size={self.type_vocab_size!r} must be a non-negative integer (0 = none).")
        if self.ffn != "none" and (not isinstance(self.d_ff, int) or isinstance(self.d_ff, bool) or self.d_ff < 1):
            raise ConfigError(f"d_ff={self.d_ff!r} must be a positive integer (or use ffn='none' for no feed-forward).")
        for f in ("rope_base", "norm_eps", "init_std"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ConfigError(f"{f}={v!r} must be a finite number > 0.")
        if self.encoder_layers is not None and (not isinstance(self.encoder_layers, int)
                                                or isinstance(self.encoder_layers, bool) or self.encoder_layers < 1):
            raise ConfigError(f"encoder_layers={self.encoder_layers!r} must be a positive integer or None (= n_layers).")
        if self.encoder_d_ff is not None and (not isinstance(self.encoder_d_ff, int)
                                              or isinstance(self.encoder_d_ff, bool) or self.encoder_d_ff < 1):
            raise ConfigError(f"encoder_d_ff={self.encoder_d_ff!r} must be a positive integer or None (= d_ff).")
        cap = self.logit_softcap
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not math.isfinite(cap) or cap < 0:
            raise ConfigError(f"logit_softcap={cap!r} must be a finite number >= 0 (0 = no soft-cap; e.g. 15).")
        for f in ("qk_norm", "qk_norm_gain", "zero_init_residual"):
            if not isinstance(getattr(self, f), bool):
                raise ConfigError(f"{f}={getattr(self, f)!r} must be true or false.")
        if self.qk_norm_gain and not self.qk_norm:
            raise ConfigError("qk_norm_gain=true needs qk_norm=true (the gain is the QK-norm's).")
        if self.rope_scaling is not None:
            check_rope_scaling(self.rope_scaling, self.head_dim)
        if self.model is None:
            self.model = "decoder" if self.causal else "encoder"
        self._check_mixers()
        self._check_layer_switches()

    def _check_layer_switches(self) -> None:
        """Gemma's switches: the unit-offset norm gain, the score scale and soft-cap, the post-norms, the
        per-layer window and RoPE base, the gated GELU feed-forward."""
        for f in ("norm_unit_offset", "post_norms"):
            if not isinstance(getattr(self, f), bool):
                raise ConfigError(f"{f}={getattr(self, f)!r} must be true or false.")
        if self.norm_unit_offset and self.norm != "rmsnorm":
            raise ConfigError("norm_unit_offset=true needs norm='rmsnorm' (the (1 + w) gain is Gemma's RMSNorm's).")
        if self.attn_scale is not None and not _positive(self.attn_scale):
            raise ConfigError(f"attn_scale={self.attn_scale!r} must be a number > 0 (e.g. 256 ** -0.5) or None.")
        cap = self.attn_softcap
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not math.isfinite(cap) or cap < 0:
            raise ConfigError(f"attn_softcap={cap!r} must be a finite number >= 0 (0 = no soft-cap; Gemma 2: 50).")
        if self.post_norms and self.norm_placement != "pre":
            raise ConfigError("post_norms=true needs norm_placement='pre' (the post-norm follows a pre-normed "
                              "sub-layer).")
        if self.ffn == "geglu" and self.activation not in ("gelu", "gelu_tanh"):
            raise ConfigError(f"ffn='geglu' gates with GELU; set activation to 'gelu' or 'gelu_tanh' "
                              f"(got {self.activation!r}).")
        layers = self.window_layers
        if layers is not None:
            if not isinstance(layers, list) or not layers or any(not isinstance(v, bool) for v in layers):
                raise ConfigError(f"window_layers={layers!r} must be a non-empty list of true/false (one per layer, "
                                  f"cycled; e.g. [true, false]) or None.")
            if self.sliding_window is None:
                raise ConfigError("window_layers needs sliding_window set (the window those layers use).")
        if self.rope_local_base is not None:
            if not _positive(self.rope_local_base) or self.positions != "rope":
                raise ConfigError(f"rope_local_base={self.rope_local_base!r} must be a number > 0 with "
                                  f"positions='rope'.")
            if self.sliding_window is None:
                raise ConfigError("rope_local_base needs sliding_window set (it is the RoPE base of the windowed "
                                  "layers).")

    def windowed(self, layer: int) -> bool:
        """Whether layer ``layer`` attends through ``sliding_window`` (see ``window_layers``)."""
        if self.sliding_window is None:
            return False
        return True if self.window_layers is None else self.window_layers[layer % len(self.window_layers)]

    def _check_mixers(self) -> None:
        """The mixer pattern's shape. Whether each name is registered, and what each mixer refuses, is
        checked where the names are resolved to classes (:func:`tformer.mixers.check_config`, called
        when a model is built or counted): the config stays plain data that imports no module."""
        pattern = [self.mixer] if isinstance(self.mixer, str) else list(self.mixer)
        if not pattern or any(not isinstance(m, str) for m in pattern) or self.n_layers % len(pattern):
            raise ConfigError(f"mixer={self.mixer!r} must be a mixer name or a non-empty list of names whose "
                              f"length divides n_layers={self.n_layers}.")
        if not isinstance(self.mixer, str):
            self.mixer = pattern
        if not isinstance(self.mixer_options, dict):
            raise ConfigError(f"mixer_options={self.mixer_options!r} must be a dict {{mixer name: {{option: value}}}}.")
        unused = sorted(set(self.mixer_options) - set(pattern))
        if unused:
            raise ConfigError(f"mixer_options names {', '.join(unused)}, which no layer uses (mixer={self.mixer!r}); "
                              f"remove them or add the mixer to the stack.")

    def layer_mixers(self) -> list[str]:
        """The mixer name of each of the ``n_layers`` layers."""
        pattern = [self.mixer] if isinstance(self.mixer, str) else self.mixer
        return [pattern[i % len(pattern)] for i in range(self.n_layers)]

    def mixer_option(self, mixer: str, key: str, default: Any = None) -> Any:
        """``mixer_options[mixer][key]``, or ``default``."""
        return self.mixer_options.get(mixer, {}).get(key, default)

    # ------------------------------------------------------------------ presets and (de)serialisation
    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> "TransformerConfig":
        """Build a named preset, optionally overriding fields: ``from_name("tiny", dropout=0.1)``."""
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}.")
        return cls.from_dict({**PRESETS[name], "name": name, **overrides})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TransformerConfig":
        """Build from a dict, refusing unknown keys with the list of valid ones."""
        valid = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - valid)
        if unknown:
            raise ConfigError(
                f"unknown config key(s) {', '.join(unknown)}; valid keys are: {', '.join(sorted(valid))}."
            )
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def n_kv_groups(self) -> int:
        """Query heads per key/value head (1 for MHA, n_heads for MQA)."""
        return self.n_heads // self.n_kv_heads


# rope_scaling["rope_type"] -> (the keys it needs, the keys it may have); the maths is tformer.nn.rope_scaling's.
ROPE_SCALINGS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "linear": (("factor",), ()),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), ()),
    "yarn": (("factor", "original_max_position_embeddings"), ("beta_fast", "beta_slow", "attention_factor", "truncate")),
    "factors": (("factors",), ()),
}


def check_rope_scaling(scaling: Any, head_dim: int) -> None:
    """Refuse a ``rope_scaling`` dict that does not name a known type with exactly its keys, each a
    positive number (``truncate`` a boolean, ``factors`` head_dim/2 positive numbers)."""
    kind = scaling.get("rope_type") if isinstance(scaling, dict) else None
    if kind not in ROPE_SCALINGS:
        raise ConfigError(f"rope_scaling={scaling!r} must be a dict whose rope_type is one of "
                          f"{', '.join(ROPE_SCALINGS)} (or rope_scaling=None for plain RoPE).")
    need, may = ROPE_SCALINGS[kind]
    keys = set(scaling) - {"rope_type"}
    if not set(need) <= keys <= set(need) | set(may):
        raise ConfigError(f"rope_scaling of type {kind!r} needs the keys {', '.join(need)}"
                          f"{' and may have ' + ', '.join(may) if may else ''}; it has {', '.join(sorted(keys))}.")
    for key in keys:
        value = scaling[key]
        if key == "truncate":
            ok = isinstance(value, bool)
        elif key == "factors":
            ok = isinstance(value, list) and len(value) == head_dim // 2 and all(_positive(v) for v in value)
        else:
            ok = _positive(value) or (key == "attention_factor" and value is None)
        if not ok:
            want = {"truncate": "true or false", "factors": f"a list of {head_dim // 2} numbers > 0"}.get(key, "a number > 0")
            raise ConfigError(f"rope_scaling[{key!r}]={value!r} must be {want}.")
    if kind == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ConfigError(f"rope_scaling high_freq_factor={scaling['high_freq_factor']} must exceed "
                          f"low_freq_factor={scaling['low_freq_factor']} (Llama 3.1: 4 and 1).")


def _positive(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v > 0


def _divisors_hint(n: int) -> str:
    return ", ".join(str(k) for k in range(1, min(n, 64) + 1) if n % k == 0 and k > 1)


PRESETS: dict[str, dict[str, Any]] = {
    # nanoGPT's CPU shakespeare shape.
    "tiny": dict(n_layers=4, n_heads=4, d_model=128, context_length=64, vocab_size=256),
    # nanoGPT's shakespeare_char shape.
    "shakespeare-char": dict(n_layers=6, n_heads=6, d_model=384, context_length=256, vocab_size=65),
    # GPT-2 small: learned positions, LayerNorm, tanh-GELU, biases, tied head.
    "gpt2-124m": dict(
        vocab_size=50257, context_length=1024, n_layers=12, n_heads=12, d_model=768,
        activation="gelu_tanh", positions="learned", norm="layernorm", bias=True,
    ),
    # A small Llama-shaped model: RoPE, GQA, RMSNorm, SwiGLU, no biases, untied head.
    "llama-style": dict(
        vocab_size=32000, context_length=2048, n_layers=8, n_heads=8, n_kv_heads=2, d_model=512,
        positions="rope", norm="rmsnorm", norm_eps=1e-6, ffn="swiglu", bias=False,
        tie_embeddings=False, rope_base=10000.0,
    ),
    # Mamba-130m's shape (state-spaces/mamba-130m): 24 Mamba layers, no feed-forward, no positions.
    "mamba-130m": dict(
        vocab_size=50280, context_length=1 << 16, n_layers=24, n_heads=1, d_model=768, mixer="mamba", ffn="none",
        positions="none", norm="rmsnorm", bias=False,
        mixer_options={"mamba": dict(d_state=16, expand=2, d_conv=4, dt_rank="auto")},
    ),
    # A BERT-sized encoder (bidirectional, post-norm).
    "bert-mini": dict(
        vocab_size=30522, context_length=512, n_layers=4, n_heads=4, d_model=256,
        norm_placement="post", causal=False, norm_eps=1e-12, activation="gelu",
        type_vocab_size=2, embedding_norm=True,
    ),
}
