"""Float decode weights in qgemv's arenas of 2 MB pages (``qgemv.arena_copy``, and the fused-decode
plan that copies every float matrix a step streams there, in the step's order): the copies hold the
same values, Linux backs the arenas with 2 MB pages where its THP setting allows it, and a model
decodes the same tokens to the bit (the same kernels read the same numbers) with the copies as
without (tiny models: 2 layers, the copies end to end in one arena); and ``decode_layers`` (every layer in one call) is ``decode_layer`` once per layer."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tformer.generation.generate import generate
from tformer.quant import fused_decode, qgemv
from tformer.quant.quantize import set_precision

from quant_models import tiny, tiny_gpt2

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(qgemv.path() not in qgemv.TILE_ROWS, reason="no SIMD tile path on this CPU")]
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
HUGE = 2 << 20


def test_arena_copy_keeps_values_in_order():
    ts = [torch.randn(300, 7), torch.arange(5000, dtype=torch.int16), torch.randn(1 << 19).half(),
          torch.randn(6, 8).t()]                                                   # not contiguous
    outs = [qgemv.arena_copy(t) for t in ts]
    for t, o in zip(ts, outs):
        assert torch.equal(t, o) and o.dtype == t.dtype and o.is_contiguous() and o.data_ptr() % 64 == 0
    assert outs[0].data_ptr() < outs[1].data_ptr() < outs[2].data_ptr()             # one after another
    del ts
    assert torch.isfinite(outs[2].float()).all()              # the copies own their memory


@pytest.mark.skipif(sys.platform != "linux" or not THP.exists() or "[never]" in THP.read_text(),
                    reason="transparent huge pages are off here")
def test_the_kernel_backs_an_arena_with_2mb_pages():
    """Where THP is 'always' or 'madvise', the advised arena takes 2 MB pages at its first touch (the
    kernel may still fall back to 4 KB pages when memory is too fragmented to find one)."""
    big = qgemv.arena_copy(torch.ones(2 << 20))                                     # 8 MB
    assert qgemv.huge_page_bytes([big]) >= HUGE
    assert qgemv.huge_page_bytes([torch.zeros(10)]) is not None                     # smaps read for any tensor


@pytest.mark.parametrize("fmt,shape", [("fp32", "gpt2"), ("fp16", "gpt2"), ("bf16", "llama"), ("q8_0", "gpt2")])
def test_plan_streams_float_weights_from_the_arenas(fmt, shape, monkeypatch):
    """Every layer's float matrices and the head's, in reading order, copied once into the arenas; a
    tied embedding moved with the head (one table); tokens equal to the bit to the same model left on
    torch's memory (TFORMER_FLOAT_ARENA=0); the copies are not inference tensors (the model may run
    under autograd after). Block tiles are the arenas' already: the plan leaves them."""
    make = {"gpt2": tiny_gpt2, "llama": tiny}[shape]
    placed, plain = set_precision(make(), fmt), set_precision(make(), fmt)
    head = placed.lm_head
    floats = fmt not in ("q8_0", "q4_0", "q4_1")
    tied = floats and placed.tok_emb.weight.data_ptr() == head.weight.data_ptr()
    before = [lin.weight.data_ptr() for b in placed.blocks for lin in fused_decode._products(b)] if floats else []
    ids = torch.tensor([[3, 17, 5, 42, 8]])
    monkeypatch.setenv(fused_decode.FLOAT_ARENA, "0")
    want = generate(plain, ids, 12, temperature=0)
    monkeypatch.delenv(fused_decode.FLOAT_ARENA)
    got = generate(placed, ids, 12, temperature=0)
    assert torch.equal(got, want)
    plan = fused_decode.plan(placed)
    assert plan is not None, fused_decode.reason(placed)
    lins = [lin for b in placed.blocks for lin in fused_decode._products(b)]
    mats = [m for layer in plan.layers for m in layer[1]]
    for lin, m in zip(lins, mats):                                                  # the layer reads what the plan reads
        assert (lin.weight if floats else lin._tiled[plan.path]).data_ptr() == m.data_ptr()
    if floats:
        ptrs = [m.data_ptr() for m in mats] + [head.weight.data_ptr()]
        assert ptrs == sorted(ptrs) and ptrs[-1] - ptrs[0] < 64 << 20              # end to end, in reading order
        assert not set(ptrs[:-1]) & set(before)                                    # copies, not the old memory
        plain_plan = fused_decode.plan(plain)
        assert [m.data_ptr() for layer in plain_plan.layers for m in layer[1]] != ptrs[:-1]
    if tied:                                   # a head kept in nn.Linear's layout shares the embedding's table
        assert placed.tok_emb.weight.data_ptr() == head.weight.data_ptr()
        assert isinstance(placed.tok_emb.weight, torch.nn.Parameter)
    assert not (floats and any(m.is_inference() for m in mats))      # F.linear under autograd saves the weight


def test_decode_layers_is_decode_layer_per_layer():
    """One call over every layer's lists equals one decode_layer call per layer (same x and caches after),
    and lists that do not split evenly into layers are refused in one sentence."""
    model = set_precision(tiny(), "q8_0")
    plan = fused_decode.plan(model)
    assert plan is not None, fused_decode.reason(model)
    states = [model.new_state(1, 16) for _ in range(2)]
    torch.manual_seed(1)
    x0 = torch.randn(1, model.config.d_model)
    write = at = torch.tensor([0])
    cos, sin = plan.rotary()
    xs = [x0.clone(), x0.clone()]
    fused_decode.run_layers(plan, xs[0], [(s.k, s.v) for s in states[0].layers], write, at, None, None)
    for (norms, mats, biases, fmts), s in zip(plan.layers, states[1].layers):
        torch.ops.tformer_qgemv.decode_layer(xs[1], norms, plan.eps, mats, biases, fmts, plan.dims, s.k, s.v,
                                             write, at, None, None, cos, sin, plan.path_id)
    assert torch.equal(xs[0], xs[1]) and not torch.equal(xs[0], x0)
    for a, b in zip(states[0].layers, states[1].layers):
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
    norms, mats, biases, fmts = plan.flat
    k = [s.k for s in states[0].layers]
    with pytest.raises(RuntimeError, match="one k and v cache per layer"):
        torch.ops.tformer_qgemv.decode_layers(xs[0], norms[:-1], plan.eps, mats, biases, fmts, plan.dims, k, k,
                                              write, at, None, None, cos, sin, plan.path_id)
