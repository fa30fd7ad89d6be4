"""The ``"short"`` attention backend: tformer's CPU kernel for short sequences (``attention_cpu.cpp``),
forward and backward, as an autograd function.

At training contexts of tens to a few hundred tokens a head's whole score matrix fits in L1, so the
kernel computes each head's rows in full (no tiles), recomputes them in the backward from the saved
log-sum-exp (as FlashAttention-2 does), and writes its outputs in the ``(B, T, heads, d)`` layout the
output projection reads. The maths is the softmax attention of :mod:`tformer.ops.sdpa`; the tests hold
it to a float64 reference of the same formula, forward and every gradient.

It serves a request when :func:`serves` says so (float32 or bfloat16 on the CPU, no mask, bias, window,
ALiBi or dropout; causal with ``n <= m`` or full; a head size that is a multiple of 8, at most
:data:`MAX_HEAD`; at most :data:`MAX_KEYS` keys) and the library builds here (AVX2 + FMA, a C++
compiler; :data:`STATUS` says why not). ``"auto"`` in :func:`~tformer.ops.sdpa.choose_backend`
takes it for such requests under autograd (a training step) up to :func:`auto_max_keys` keys, where it
was measured faster than PyTorch's fused kernel on CPUs of the same vector width (512 keys where PyTorch
runs AVX2, 256 where it runs AVX-512; docs/training.md); inference keeps PyTorch's.

bfloat16 (a training step under autocast) is read and written as it is: each task widens its head's rows to
float32 (exact) and rounds its results once, to nearest even, so the values are the float32 kernel's on
widened copies, rounded (the backward's ``D_i = dout_i · out_i`` then reads the bf16 output, as PyTorch's bf16
flash kernels do); what it saves is eight casts a layer, four each way, on strided views, which measured a few
percent of a whole bf16 step (docs/training-speed-log.md#issue-26-the-recipes-the-kernels-and-three-machines).
"""

from __future__ import annotations

import math
import threading
from pathlib import Path

import torch

from tformer.errors import InputError
from tformer.extensions import build_once, compile_library

Tensor = torch.Tensor
SOURCE = Path(__file__).with_name("attention_cpu.cpp")
HEADERS = [SOURCE.with_name(h) for h in ("vec_exp.h", "vec_bf16.h", "flush_denormal.h")]
STATUS: dict[str, str] = {}           # "state": "built" | "unavailable: <why>" (after the first load())
_LOCK = threading.Lock()
_OP: list = []
MAX_KEYS = 1024                       # per-task row buffers; above this the tiled kernels fit better
MAX_HEAD = 256
# ``auto`` takes the kernel up to this many keys, by the vector width PyTorch's own fused kernel runs at
# (``torch.backends.cpu.get_cpu_capability()``): the kernel is AVX2 on every CPU, PyTorch's is as wide as
# the CPU. Set where whole training steps stopped favouring the kernel (benchmarks/training/cpu_kernels.py;
# it also saves the layout copies around attention, so a step favours it more than attention alone does):
# against AVX2 it wins until a head's rows no longer fit the caches whole (past 512 keys), against
# AVX-512 from fewer keys (past 256). The figures: benchmarks/results/training/cpu_kernels-epyc-b.md
# (AVX2) and docs/training-speed-log.md#issue-26-the-recipes-the-kernels-and-three-machines (AVX-512).
# Any other capability (no AVX2: the kernel cannot run; another architecture) keeps PyTorch's.
AUTO_MAX_KEYS = {"AVX2": 512, "AVX512": 256}
# read once: ATen fixes its capability when it starts (ATEN_CPU_CAPABILITY), and a compiled training step
# must not call out to ask (a graph break)
CAPABILITY = torch.backends.cpu.get_cpu_capability()


def auto_max_keys() -> int:
    """The most keys ``auto`` gives the kernel on this CPU (0: never): :data:`AUTO_MAX_KEYS` of the
    capability PyTorch's own kernels run at here (:data:`CAPABILITY`)."""
    return AUTO_MAX_KEYS.get(CAPABILITY, 0)


def _build():
    op = compile_library("tformer_attention", [SOURCE], HEADERS, "the CPU attention kernel", needs={"avx2", "fma"})

    @torch.library.register_fake("tformer_attention::attend")
    def _attend_shape(q, k, v, causal, scale):          # lets torch.compile trace through the op
        B, H, n, D = q.shape
        return q.new_empty(B, n, H, D).permute(0, 2, 1, 3), q.new_empty(B, H, n, dtype=torch.float32)   # lse float32

    @torch.library.register_fake("tformer_attention::attend_backward")
    def _backward_shape(dout, q, k, v, out, lse, causal, scale):
        B, Hk, m, D = k.shape
        return (q.new_empty(q.shape[0], q.shape[2], q.shape[1], D).permute(0, 2, 1, 3),
                k.new_empty(B, m, Hk, D).permute(0, 2, 1, 3), k.new_empty(B, m, Hk, D).permute(0, 2, 1, 3))

    @torch.library.register_fake("tformer_attention::rotate")
    def _rotate_shape(x, cos, sin, inverse):
        return x.new_empty(x.shape)
    return op


def load():
    """The ``torch.ops.tformer_attention`` namespace, building it the first time; ``None`` when it cannot
    be built here (the reason is in ``STATUS["state"]``)."""
    return build_once(_build, _OP, _LOCK, STATUS)


def serves(q: Tensor, k: Tensor, v: Tensor, *, mask=None, bias=None, causal: bool = False, window=None,
           alibi_slopes=None, dropout_p: float = 0.0) -> str | None:
    """``None`` when the kernel can compute this request, else why not (one phrase)."""
    if q.device.type != "cpu" or len({q.dtype, k.dtype, v.dtype}) != 1 or q.dtype not in (torch.float32, torch.bfloat16):
        return "not float32 or bfloat16 on the CPU"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "not (B, heads, T, d)"
    if mask is not None or bias is not None or window is not None or alibi_slopes is not None or dropout_p > 0:
        return "a mask, bias, window, ALiBi or dropout"
    n, m, d = q.shape[-2], k.shape[-2], q.shape[-1]
    if causal and n > m:
        return "causal with more queries than keys"
    if d % 8 or d > MAX_HEAD or v.shape[-1] != d:
        return f"head size {d} (it takes multiples of 8 up to {MAX_HEAD}, the same for values)"
    if m > MAX_KEYS or m == 0:
        return f"{m} keys (it takes 1 to {MAX_KEYS})"
    return None


def preferred(q: Tensor, k: Tensor, v: Tensor, **request) -> bool:
    """Whether ``auto`` should take the kernel for this request: it :func:`serves` it, at most
    :func:`auto_max_keys` keys (where it measured faster on CPUs of this vector width), and the library is
    built here."""
    return serves(q, k, v, **request) is None and k.shape[-2] <= auto_max_keys() and load() is not None


class _Attend(torch.autograd.Function):
    """softmax(scale · Q Kᵀ [causal]) V by the kernel; the backward recomputes the weights from the
    saved log-sum-exp."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Tensor:
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        out, lse = load().attend(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale = causal, scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        g = g if g.stride(-1) == 1 else g.contiguous()
        dq, dk, dv = load().attend_backward(g, q, k, v, out, lse, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None


def short_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, bias: Tensor | None, causal: bool,
                    window: int | None, scale: float | None, dropout_p: float, *, alibi_slopes=None) -> Tensor:
    """The backend entry (the signature of ``EXTRA_BACKENDS``): ``(B, Hq, n, d)`` attention output.

    Raises:
        InputError: the request is one the kernel does not take (:func:`serves` names why), or the
            library could not be built here (``STATUS`` says why).
    """
    why = serves(q, k, v, mask=mask, bias=bias, causal=causal, window=window, alibi_slopes=alibi_slopes,
                 dropout_p=dropout_p)
    if why is not None:
        raise InputError(f"attention backend 'short' cannot take this request ({why}); use backend='auto'.")
    if load() is None:
        raise InputError(f"attention backend 'short' is not available here ({STATUS['state']}); use backend='auto'.")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return _Attend.apply(q, k, v, causal, scale)


class _Rotate(torch.autograd.Function):
    """RoPE's rotation by the kernel; its backward is the rotation by minus the angles (the transpose)."""

    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x if x.stride(-1) == 1 else x.contiguous()
        ctx.save_for_backward(cos, sin)
        return load().rotate(x, cos, sin, False)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        cos, sin = ctx.saved_tensors
        return load().rotate(g if g.stride(-1) == 1 else g.contiguous(), cos, sin, True), None, None


def rotates(x: Tensor, cos: Tensor) -> bool:
    """Whether :func:`rotate` takes ``x (B, H, T, D)`` with tables like ``cos``: float32 on the CPU (or
    bfloat16 with D a multiple of 8: each row widened, rotated with the float32 tables, rounded once), in a
    step that records a graph (training: measured there), tables ``(T, D)`` or ``(B, T, D)``, and the
    library built here."""
    return (x.device.type == "cpu" and cos.dtype == torch.float32 and x.dim() == 4
            and (x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and x.shape[-1] % 8 == 0))
            and cos.dim() in (2, 3) and cos.shape[-2:] == x.shape[-2:] and x.shape[-1] % 2 == 0
            and torch.is_grad_enabled() and x.requires_grad and load() is not None)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x cos + rotate_half(x) sin`` for ``x (B, H, T, D)`` and tables ``(T, D)`` or ``(B, T, D)`` in one
    pass each way (where :func:`rotates` holds; differentiable in ``x``). In bfloat16 it replaces five bf16
    ops (neg, cat, two multiplies, an add) and two table casts a call, in float32 eight ops each way;
    both measured faster in whole steps (docs/training.md#how-the-cpu-training-step-is-made-fast)."""
    return _Rotate.apply(x, cos.contiguous(), sin.contiguous())
