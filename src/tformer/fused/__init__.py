"""Whole decoder layers in one C++ call, for prompts, decode steps and speculative checks, on float or block weights.

A decode step of SmolLM2-135M through the modules is 30 layers of ~50 small torch ops each (norms,
RoPE, the cache write, attention over the cache, SiLU, residual adds) around 5 products: at 576
wide their Python and dispatch cost is about as large as reading the weights. Here every layer of a
call runs in one call of ``tformer_fused::layers`` (``layers.cpp``), for the two block shapes
tformer's models come in:

    Llama:  h = RMSNorm(x) g;  [q|k|v] = h Wqkvᵀ;  RoPE(q, k) at pos;  K[pos], V[pos] <- k, v
            x += softmax(q Kᵀ / sqrt(hs)) V · Woᵀ          (GQA: head h reads kv head h // (nh/nkv))
            h = RMSNorm(x) g;  x += (silu(h Wgᵀ) * (h Wuᵀ)) Wdᵀ
    GPT-2:  the same with LayerNorm (g, b), a bias on every product, no rotation (the learned
            position is added to the token embedding before the first layer) and
            x += act(h Wuᵀ + b) Wdᵀ + b  (act: GELU, tanh or erf form; ReLU; ReLU²; SiLU)

then the final norm and the LM head as modules. A product is a :class:`~tformer.quant.block_linear.BlockLinear`'s
tiles (the same tile kernels and activation rounding as the module path, ``quant/tiles.h``, so those
products are its to the bit) or a float :class:`~tformer.quant.quantize.DecodeLinear`'s weight
(float32, bfloat16 or float16, widened in registers by the GEMV's loops); the norm, softmax and
weighted sum differ from the module path only in float summation order. The residual stream is
float32 in every case; the KV cache keeps the model's dtype.

When it applies: the model is a pre-norm stack of :class:`~tformer.mixers.attention.MultiHeadAttention`
layers with RMSNorm + SwiGLU + RoPE (rotate-half) or LayerNorm + a GELU / ReLU / ReLU² / SiLU MLP +
learned positions, without QK-norm, sliding window, ALiBi, logit soft-cap, every product a
BlockLinear on a SIMD tile path or a float DecodeLinear (what :func:`tformer.quant.set_precision`
makes), in eval mode. That is decided once per model (:func:`choose`, :func:`chosen`:
:mod:`tformer.fused.plan`); each call then needs no hooks and a state and token count the kernel
serves (:func:`route`: :mod:`tformer.fused.run`). :mod:`tformer.generation.step` asks the route once
per call and runs either :func:`forward` / :func:`decode` or the module path.
``TFORMER_FUSED_DECODE=0`` (read when the choice is made) sends every model to the module path.
"""

from tformer.fused.plan import SWITCH, Choice, Plan, choose, chosen, why_not
from tformer.fused.run import MAX_FLOAT_ROWS, MAX_TOKENS, Route, decode, forward, route, run_layers

__all__ = ["SWITCH", "MAX_TOKENS", "MAX_FLOAT_ROWS", "Choice", "Plan", "Route", "choose", "chosen", "why_not",
           "route", "forward", "decode", "run_layers"]
