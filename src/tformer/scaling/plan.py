"""The compute planner: from a budget (or N, or D) to a model you can build, its run time and its memory.

1. **Allocation.** Each law of :mod:`.laws` turns the budget into (N, D) on ``C = 6ND``; given N
   (or D) instead, the budget is the one whose optimum has that N (or D).
2. **A concrete config near N.** Widths of 64·k with 64-wide heads, depths giving
   ``d_model / n_layers`` between 32 and 128 (the flat region of Kaplan et al.'s Figure 5, and the
   range of Chinchilla's own models), and the depth that brings the exact parameter count of
   :func:`tformer.accounting.count_parameters` nearest N.
3. **Time here.** The model's training FLOPs (:func:`~tformer.accounting.training_flops_per_token`
   × D) divided by FLOP/s *measured* on this machine with a few training steps of a proxy: the same
   architecture cut to at most 2 layers, width 512 and context 256 (a billion-parameter step does
   not fit a laptop; larger matmuls usually run faster per FLOP, so the estimate errs long).
4. **Memory of training**, fp32 weights with AdamW: parameters (4 bytes each), gradients (4),
   AdamW's two moments (8), and the activations autograd keeps for the backward pass
   (:func:`activation_bytes`); plus the KV cache (each mixer's state) of one full-context sequence.

No scipy: this module needs only the core install.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass

from tformer.accounting import count_parameters, state_bytes, training_flops_per_token
from tformer.config import PRESETS, TransformerConfig
from tformer.errors import ConfigError, InputError
from tformer.scaling.laws import LAWS, ChinchillaLaw, KaplanAllocation

MIN_ASPECT, MAX_ASPECT = 32, 128          # d_model / n_layers


@dataclass(frozen=True)
class Allocation:
    """One law's answer: N parameters on D tokens for C = 6ND FLOPs, and its predicted loss."""

    law: str
    flops: float
    n_params: float
    n_tokens: float
    loss: float | None            # None for Kaplan (their loss is on another corpus and tokenizer)
    non_embedding: bool           # Kaplan's N excludes the embeddings

    @property
    def tokens_per_param(self) -> float:
        return self.n_tokens / self.n_params


def allocate(law: ChinchillaLaw | KaplanAllocation, *, flops: float | None = None, params: float | None = None,
             tokens: float | None = None) -> Allocation:
    """The compute-optimal (N, D, C) under ``law`` given exactly one of ``flops``, ``params``, ``tokens``."""
    given = {k: v for k, v in (("flops", flops), ("params", params), ("tokens", tokens)) if v is not None}
    if len(given) != 1:
        raise InputError(f"give exactly one of a FLOP budget, a parameter count or a token count, got {sorted(given) or 'none'}.")
    (kind, value), = given.items()
    if not (value > 0 and math.isfinite(value)):
        raise InputError(f"the {kind} to plan for must be a positive number, got {value}.")
    c = {"flops": lambda: value, "params": lambda: law.flops_for_n(value), "tokens": lambda: law.flops_for_d(value)}[kind]()
    n = law.optimal_n(c)
    d = c / (6 * n)
    loss = law.loss(n, d) if isinstance(law, ChinchillaLaw) else None
    return Allocation(law.name, c, n, d, loss, isinstance(law, KaplanAllocation))


def _shape(base: dict, n_layers: int, d_model: int) -> TransformerConfig:
    heads = max(1, d_model // 64)
    group = base.get("n_heads", 1) // (base.get("n_kv_heads") or base.get("n_heads", 1))
    kv = heads // group if group > 1 and heads % group == 0 else heads
    kw = {k: v for k, v in base.items() if k not in ("d_ff", "head_dim", "n_kv_heads")}
    return TransformerConfig.from_dict({**kw, "n_layers": n_layers, "d_model": d_model, "n_heads": heads,
                                        "n_kv_heads": kv})


def config_near(n_params: float, preset: str = "llama-style", non_embedding: bool = False) -> TransformerConfig:
    """The ``preset``-shaped config (vocabulary, context, norms, FFN kept) whose parameter count
    is nearest ``n_params`` among widths 64·k and depths with ``32 <= d_model/n_layers <= 128``.

    The count is linear in depth at a fixed width, so for each width two counts give the best depth.
    """
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}.")
    if not n_params > 0:
        raise InputError(f"the parameter count must be positive, got {n_params}.")
    base = {**PRESETS[preset], "name": preset}
    measure = (lambda c: count_parameters(c).non_embedding) if non_embedding else (lambda c: count_parameters(c).total)
    best = None
    for d_model in range(64, 64 * 512 + 1, 64):
        lo, hi = max(1, math.ceil(d_model / MAX_ASPECT)), max(1, d_model // MIN_ASPECT)
        one, two = measure(_shape(base, 1, d_model)), measure(_shape(base, 2, d_model))
        per_layer, fixed = two - one, 2 * one - two
        depth = min(hi, max(lo, round((n_params - fixed) / per_layer)))
        error = abs(math.log((fixed + depth * per_layer) / n_params))
        if best is None or error < best[0] - 1e-12:
            best = (error, depth, d_model)
        if fixed + lo * per_layer > 4 * n_params:
            break                                        # every wider model is larger still
    return _shape(base, best[1], best[2])


def activation_bytes(config: TransformerConfig, batch_size: int, seq_len: int, bytes_per_value: int = 4,
                     attention_matrix: bool = False) -> int:
    """Bytes of the activations autograd keeps for backward in one training step (decoder, pre- or post-norm).

    Per token and layer (in values): the first norm's input and output (2d), Q, K, V
    (d_q + 2 d_kv), the attention output before and after merging heads (2 d_q), the second
    norm's input and output (2d), and the feed-forward's hidden activations (2 d_ff for an MLP:
    the pre-activation and the activation; 4 d_ff for SwiGLU: gate, up, silu(gate) and their
    product). This is Korthikanti et al.'s (2022) ``34 s b h`` bytes at 2 bytes per value for a
    4d MLP, without dropout masks. ``attention_matrix`` adds the ``n_heads · T`` softmax weights
    per token that a non-fused (math) attention keeps. Outside the layers: the embedding output,
    the final norm's input and output, and the logits with their log-softmax (2 V per token).
    """
    c = config
    d_q, d_kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    ffn = 4 * c.d_ff if c.ffn in ("swiglu", "geglu") else 2 * c.d_ff
    per_layer = 4 * c.d_model + d_q + 2 * d_kv + 2 * d_q + ffn + (c.n_heads * seq_len if attention_matrix else 0)
    per_token = c.n_layers * per_layer + 3 * c.d_model + c.vocab_size
    return int(per_token * batch_size * seq_len * bytes_per_value)


@dataclass(frozen=True)
class Memory:
    """Bytes of a training step (fp32 AdamW) and of one sequence's KV cache at inference."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    kv_cache: int

    @property
    def training(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations


def training_memory(config: TransformerConfig, batch_size: int, seq_len: int, kv_bytes_per_value: int = 2) -> Memory:
    """fp32 weights and gradients, AdamW's exp_avg and exp_avg_sq (8 bytes per parameter),
    activations at ``batch_size × seq_len``, and the inference state of one ``seq_len``-token
    sequence (:func:`tformer.accounting.state_bytes`: the KV cache for attention layers)."""
    n = count_parameters(config).total
    return Memory(parameters=4 * n, gradients=4 * n, optimizer=8 * n,
                  activations=activation_bytes(config, batch_size, seq_len),
                  kv_cache=state_bytes(config, seq_len, 1, kv_bytes_per_value))


def proxy_config(config: TransformerConfig) -> TransformerConfig:
    """The config cut to at most 2 layers, width 512 (heads kept 64 wide) and context 256, for timing."""
    kw = {k: v for k, v in asdict(config).items() if k not in ("d_ff", "head_dim", "n_heads", "n_kv_heads")}
    d = min(config.d_model, 512)
    heads = max(1, d // config.head_dim) if d % config.head_dim == 0 else 1
    group = config.n_heads // config.n_kv_heads
    kv = heads // group if heads % group == 0 and heads >= group else heads
    return TransformerConfig.from_dict({**kw, "n_layers": min(config.n_layers, 2), "d_model": d, "n_heads": heads,
                                        "n_kv_heads": kv, "context_length": min(config.context_length, 256),
                                        "vocab_size": min(config.vocab_size, 8192)})


def measure_flops_per_second(config: TransformerConfig, batch_size: int = 4, seconds: float = 2.0) -> float:
    """Training FLOP/s achieved here by forward + backward + AdamW steps of :func:`proxy_config` (median step)."""
    import torch

    from tformer.models.decoder import DecoderLM
    from tformer.training.optim import make_optimizer

    proxy = proxy_config(config)
    T = proxy.context_length
    gen = torch.Generator().manual_seed(0)
    model = DecoderLM(proxy)
    opt = make_optimizer(model, 1e-4, (0.9, 0.95), 0.0, "cpu")
    ids = torch.randint(0, proxy.vocab_size, (batch_size, T + 1), generator=gen)
    times, start = [], time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < seconds and len(times) < 50):
        t = time.perf_counter()
        _, loss = model(ids[:, :-1], targets=ids[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t)
    step = statistics.median(times[1:])                     # the first step pays for allocation
    return training_flops_per_token(proxy, T) * batch_size * T / step


FAR = 10       # a concrete config more than this many times smaller (or larger) than N is not "near N": refused


def make_plan(*, flops: float | None = None, hours: float | None = None, params: float | None = None,
              tokens: float | None = None, law: str = "Besiroglu 2024", preset: str = "llama-style",
              batch_size: int = 8, seq_len: int | None = None, flops_per_second: float | None = None) -> dict:
    """Everything ``tformer plan`` prints, as a dict (see the module docstring for each step)."""
    chosen = next((x for x in LAWS if x.name.lower().startswith(law.lower())), None)
    if chosen is None:
        raise ConfigError(f"unknown law {law!r}; choose one of {', '.join(x.name for x in LAWS)}.")
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}.")
    if batch_size < 1:
        raise InputError(f"--batch-size {batch_size} must be >= 1.")
    if hours is not None:
        if not hours > 0:
            raise InputError(f"--hours {hours} must be positive.")
        if flops is not None or params is not None or tokens is not None:
            raise InputError("give exactly one of --flops, --hours, --params, --tokens.")
    measured = flops_per_second is None
    if measured:
        flops_per_second = measure_flops_per_second(TransformerConfig.from_name(preset))
    if hours is not None:
        flops = hours * 3600 * flops_per_second
    allocations = [allocate(x, flops=flops, params=params, tokens=tokens) for x in LAWS]
    pick = allocations[LAWS.index(chosen)]
    config = config_near(pick.n_params, preset, non_embedding=pick.non_embedding)
    T = seq_len or config.context_length
    count = count_parameters(config)
    n_model = count.non_embedding if pick.non_embedding else count.total
    if n_model * FAR < pick.n_params:
        raise InputError(f"{chosen.name}'s N = {pick.n_params:.3g} parameters is beyond the largest {preset} config "
                         f"this planner builds ({n_model:.3g}: d_model up to {64 * 512}); plan for a smaller budget.")
    if n_model > FAR * pick.n_params:
        raise InputError(f"{chosen.name}'s N = {pick.n_params:.3g} parameters is below the smallest {preset} config "
                         f"this planner builds ({n_model:.3g}: one layer, d_model 64), so no plan fits the budget; "
                         f"plan for a larger one{'' if preset == 'tiny' else ', or for a smaller model (--preset tiny)'}.")
    train_flops = training_flops_per_token(config, T) * pick.n_tokens
    return {"given": {"flops": flops if hours is None else None, "hours": hours, "params": params, "tokens": tokens},
            "allocations": [{**asdict(a), "tokens_per_param": a.tokens_per_param} for a in allocations],
            "law": chosen.name, "preset": preset, "config": config.to_dict(),
            "config_params": n_model, "config_params_total": count.total,
            "batch_size": batch_size, "seq_len": T, "steps": math.ceil(pick.n_tokens / (batch_size * T)),
            "train_flops": train_flops, "flops_per_second": flops_per_second, "measured": measured,
            "seconds": train_flops / flops_per_second,
            "memory": {**asdict(training_memory(config, batch_size, T)),
                       "training": training_memory(config, batch_size, T).training}}
