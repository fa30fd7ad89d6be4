"""Decode weights on 2 MB pages (tformer.quant.huge_pages, and the fused-decode plan that moves a
model's streamed matrices into an arena): the copies hold the same values where the arena says,
Linux backs the arena with 2 MB pages where its THP setting allows it, and a model decodes the same
tokens to the bit (the same kernels read the same numbers) with the arena as without."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch

from tformer.generation.generate import generate
from tformer.quant import fused_decode, huge_pages, qgemv
from tformer.quant.block_linear import BlockLinear
from tformer.quant.quantize import set_precision

from quant_models import tiny, tiny_gpt2

pytestmark = pytest.mark.usefixtures("one_thread")
linux = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no madvise(MADV_HUGEPAGE) here")
needs_tiles = pytest.mark.skipif(qgemv.path() not in qgemv.TILE_ROWS, reason="no SIMD tile path on this CPU")
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@linux
def test_arena_copies_side_by_side_on_aligned_slots():
    ts = [torch.randn(300, 7), torch.arange(5000, dtype=torch.int16), torch.randn(1 << 19).half()]
    a = huge_pages.Arena(sum(huge_pages._slot(t.numel() * t.element_size()) for t in ts))
    assert a.bytes.data_ptr() % huge_pages.HUGE == 0
    outs = [a.put(t) for t in ts]
    for t, o in zip(ts, outs):
        assert torch.equal(t, o) and o.dtype == t.dtype and o.is_contiguous() and o.data_ptr() % huge_pages.ALIGN == 0
        assert a.bytes.data_ptr() <= o.data_ptr() < a.bytes.data_ptr() + a.bytes.numel()
    assert outs[0].data_ptr() < outs[1].data_ptr() < outs[2].data_ptr()          # in the order put
    with pytest.raises(ValueError, match="do not fit"):
        a.put(torch.zeros(1))
    del a                                                    # the tensors keep the mapping alive
    assert torch.equal(outs[2], ts[2])


def test_no_arena_when_switched_off_or_small(monkeypatch):
    big = [torch.zeros(1 << 20)]                             # 4 MB
    monkeypatch.setenv(huge_pages.SWITCH, "0")
    assert huge_pages.arena(big) is None
    monkeypatch.delenv(huge_pages.SWITCH)
    assert huge_pages.arena([torch.zeros(10)]) is None
    assert (huge_pages.arena(big) is not None) == huge_pages.enabled()


@linux
@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="transparent huge pages are off here")
def test_the_kernel_backs_a_touched_arena_with_2mb_pages():
    """Where THP is 'always' or 'madvise', the advised mapping takes 2 MB pages at its first touch (the
    kernel may still fall back to 4 KB pages when memory is too fragmented to find one: not here)."""
    a = huge_pages.Arena(8 << 20)
    a.put(torch.ones(2 << 20))                               # 8 MB written
    assert huge_pages.huge_bytes(a.bytes) >= huge_pages.HUGE
    assert huge_pages.huge_bytes(torch.zeros(10)) is not None  # smaps read for an ordinary tensor too


def _inside(t, arena_bytes) -> bool:
    return arena_bytes[0] <= t.data_ptr() < arena_bytes[1]


def _arena_range(plan) -> tuple[int, int]:
    first = plan.layers[0][1][0]
    return first.data_ptr(), first.data_ptr() + (256 << 20)


@linux
@needs_tiles
@pytest.mark.parametrize("fmt,shape", [("fp32", "gpt2"), ("fp16", "gpt2"), ("q8_0", "gpt2"), ("q4_1", "llama")])
def test_plan_streams_from_one_arena_and_decodes_the_same_tokens(fmt, shape, monkeypatch):
    """Every layer's matrices and the head's, in reading order, in one arena; a tied embedding moved with
    the head (one copy); tokens equal to the bit to the same model without the arena; the weights are
    not inference tensors (the model still runs under autograd)."""
    monkeypatch.setattr(huge_pages, "MIN_BYTES", 0)         # the tiny models are smaller than one 2 MB page
    make = {"gpt2": tiny_gpt2, "llama": tiny}[shape]
    placed, plain = set_precision(make(), fmt), set_precision(make(), fmt)
    ids = torch.tensor([[3, 17, 5, 42, 8]])
    head = placed.lm_head
    tied = not isinstance(head, BlockLinear) and placed.tok_emb.weight.data_ptr() == head.weight.data_ptr()
    monkeypatch.setenv(huge_pages.SWITCH, "0")
    want = generate(plain, ids, 12, temperature=0)
    monkeypatch.delenv(huge_pages.SWITCH)
    got = generate(placed, ids, 12, temperature=0)
    assert torch.equal(got, want)
    plan = fused_decode.plan(placed)
    assert plan is not None, fused_decode.reason(placed)
    mats = [m for layer in plan.layers for m in layer[1]]
    head_mat = head._tiled[plan.path] if isinstance(head, BlockLinear) else head.weight
    ptrs = [m.data_ptr() for m in mats + [head_mat]]
    assert ptrs == sorted(ptrs) and ptrs[-1] - ptrs[0] < 64 << 20          # one arena, in reading order
    assert ptrs[0] % huge_pages.HUGE == 0
    for lin, m in zip((lin for b in placed.blocks for lin in fused_decode._products(b)), mats):
        held = lin._tiled[plan.path] if isinstance(lin, BlockLinear) else lin.weight
        assert held.data_ptr() == m.data_ptr()                              # the layer reads the arena's copy
    if tied:                                                 # a head kept in nn.Linear's layout shares the table
        assert placed.tok_emb.weight.data_ptr() == head.weight.data_ptr()   # still one table
        assert isinstance(placed.tok_emb.weight, torch.nn.Parameter)
    assert not any(m.is_inference() for m in mats + [head_mat])
    assert plan.layers[0][1][0].data_ptr() != fused_decode.plan(plain).layers[0][1][0].data_ptr()


def test_decode_layers_is_decode_layer_per_layer():
    """One call over every layer's lists equals one decode_layer call per layer (same x and caches after),
    and lists that do not split evenly into layers are refused in one sentence."""
    if qgemv.path() not in qgemv.TILE_ROWS:
        pytest.skip("no SIMD tile path on this CPU")
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
    assert torch.equal(xs[0], xs[1])
    for a, b in zip(states[0].layers, states[1].layers):
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
    norms, mats, biases, fmts = plan.flat
    k = [s.k for s in states[0].layers]
    with pytest.raises(RuntimeError, match="one k and v cache per layer"):
        torch.ops.tformer_qgemv.decode_layers(xs[0], norms[:-1], plan.eps, mats, biases, fmts, plan.dims, k, k,
                                              write, at, None, None, cos, sin, plan.path_id)
