"""Whole decoder layers in one C++ call, for prompts, decode steps and speculative checks, on float or block weights.

Every layer of a model call runs inside one call of ``tformer_fused::layers`` (``layers.cpp``)
instead of ~50 small torch ops a layer (why it pays: docs/inference.md), each layer

    Llama:  h = RMSNorm(x) g;  [q|k|v] = h Wqkvᵀ;  RoPE(q, k) at pos;  K[pos], V[pos] <- k, v
            x += softmax(q Kᵀ / sqrt(hs)) V · Woᵀ          (GQA: head h reads kv head h // (nh/nkv))
            h = RMSNorm(x) g;  x += (silu(h Wgᵀ) * (h Wuᵀ)) Wdᵀ
    GPT-2:  the same with LayerNorm (g, b), a bias on every product, no rotation (the learned
            position is added to the token embedding first) and x += act(h Wuᵀ + b) Wdᵀ + b
            (act: GELU, tanh or erf form; ReLU; ReLU²; SiLU)

then the final norm and the LM head as modules. A product is a BlockLinear's tiles (the module
path's tile kernels and activation rounding, ``quant/tiles.h``: its products to the bit) or a float
DecodeLinear's rows (float32, bfloat16 or float16, widened in registers); the norms, softmax and
weighted sum differ from the module path only in float summation order. The residual stream is
float32 throughout; the KV cache keeps the model's dtype.

It applies to a pre-norm stack of MultiHeadAttention layers (RMSNorm + SwiGLU + rotate-half RoPE, or
LayerNorm + a plain MLP + learned positions) without QK-norm, window, ALiBi or soft-cap, every
product a BlockLinear on a SIMD tile path or a float DecodeLinear (what ``set_precision`` makes), in
eval mode: decided once per model (:func:`choose`, :func:`chosen`, :mod:`tformer.fused.plan`;
``TFORMER_FUSED_DECODE=0`` read then turns it off). Each call then needs no hooks and a state and
token count the kernel serves (:func:`route`, :mod:`tformer.fused.run`);
:mod:`tformer.generation.step` asks the route once per call and runs :func:`forward` /
:func:`decode` or the module path.
"""

from tformer.fused.plan import SWITCH, Choice, Plan, choose, chosen, why_not
from tformer.fused.run import MAX_FLOAT_ROWS, MAX_TOKENS, Route, decode, forward, route, run_layers

__all__ = ["SWITCH", "MAX_TOKENS", "MAX_FLOAT_ROWS", "Choice", "Plan", "Route", "choose", "chosen", "why_not",
           "route", "forward", "decode", "run_layers"]
