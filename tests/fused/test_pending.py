"""The whole-layer plan's tiles made on a thread of their own when the model opens (``choose(model,
background=True)``, what ``open_model`` asks) and waited for at the plan's first use.

Checked: the logits of the deferred plan equal the eager plan's bit for bit (the same tiles, made at
another time, some by the background thread and the rest by the first use from the other end); an error raised while the tiles are made surfaces at the first use, with the frame that
raised it, and again at every later use (never a half-made plan); two threads at the first use at once
both wait and get the same plan, each matrix tiled once; a module-path product racing the background
thread makes no tile twice; ``open_model`` chooses the path at once and leaves only the tiles pending.
"""

from __future__ import annotations

import copy
import sys
import threading
import traceback
from pathlib import Path

import pytest
import torch

import tformer.fused as whole
from tformer.fused.pending import Pending
from tformer.generation.step import decode_step, prefill
from tformer.quant import qgemv
from tformer.quant.block_linear import BlockLinear
from tformer.quant.quantize import set_precision

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "quant"))
from quant_models import tiny  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(qgemv.path() not in qgemv.TILE_ROWS, reason="no SIMD tile path on this CPU")]
IDS = torch.tensor([[3, 17, 5, 42, 8, 11, 2], [9, 1, 30, 7, 7, 60, 4]])


def tiled_layers(model) -> list[BlockLinear]:
    """The decoder layers' tiled products (what the plan tiles; the head runs as a module)."""
    return [m for m in model.blocks.modules() if isinstance(m, BlockLinear) and m.tiled]


def run(model, steps: int = 6) -> list[torch.Tensor]:
    """Prompt logits, then greedy steps' logits, on the whole-layer route (asserted)."""
    state = model.new_state(2, 40)
    assert whole.route(model, state, *IDS.shape) is not None
    with torch.inference_mode():
        out = [prefill(model, IDS, state)]
        for _ in range(steps):
            last = out[-1].reshape(2, -1, out[-1].shape[-1])[:, -1]                     # (B, vocab)
            out.append(decode_step(model, last.argmax(-1, keepdim=True), state))
    return out


@pytest.fixture
def slow_tiles(monkeypatch):
    """qgemv.tiles held at a gate until the test opens it, each call counted per layer's blocks."""
    gate, calls, real = threading.Event(), [], qgemv.tiles

    def held(packed, *args, **kw):
        calls.append(packed.data_ptr())
        assert gate.wait(60), "the gate was never opened"
        return real(packed, *args, **kw)

    monkeypatch.setattr(qgemv, "tiles", held)
    return gate, calls


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_deferred_tiles_give_the_eager_plans_logits_bit_for_bit(fmt):
    eager = set_precision(tiny(), fmt)
    deferred = copy.deepcopy(eager)                  # no tiles made yet in either
    assert all(not m._tiled for m in tiled_layers(deferred))
    assert whole.choose(eager).plan.ready
    choice = whole.choose(deferred, background=True)
    assert choice.plan is not None and choice.reason == whole.chosen(eager).reason
    threads = torch.get_num_threads()
    for a, b in zip(run(eager), run(deferred)):
        assert torch.equal(a, b)
    assert choice.plan.ready and torch.get_num_threads() == threads     # the first use's own repacks restore it


def test_an_error_in_the_background_surfaces_at_the_first_use(monkeypatch):
    model = set_precision(tiny(), "q4_1")

    def broken(*args, **kw):
        raise RuntimeError("planted: the repack failed")

    monkeypatch.setattr(qgemv, "tiles", broken)
    choice = whole.choose(model, background=True)    # the open itself does not raise
    assert choice.plan is not None
    state = model.new_state(2, 40)
    for _ in range(2):                               # every use raises: never a half-made plan
        with pytest.raises(RuntimeError, match="planted") as err, torch.inference_mode():
            prefill(model, IDS, state)
        assert "broken" in "".join(traceback.format_tb(err.value.__traceback__))   # the thread's frame is kept
    assert not choice.plan.ready


def test_two_threads_at_the_first_use_both_wait_for_one_build(slow_tiles):
    gate, calls = slow_tiles
    model = set_precision(tiny(), "q4_1")
    plan = whole.choose(model, background=True).plan
    got, errors = [], []

    def first_use():
        try:
            got.append(plan.flat)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    users = [threading.Thread(target=first_use) for _ in range(2)]
    for t in users:
        t.start()
    for t in users:
        t.join(0.2)
    assert all(t.is_alive() for t in users) and not plan.ready     # both wait while the tiles are held
    gate.set()
    for t in users:
        t.join(60)
    assert not errors and len(got) == 2 and got[0] is got[1]
    assert sorted(calls) == sorted({m.blocks.data_ptr() for m in tiled_layers(model)})   # each matrix once


def test_a_module_path_product_racing_the_background_makes_each_tile_once(slow_tiles):
    gate, calls = slow_tiles
    model = set_precision(tiny(), "q4_1")
    reference = copy.deepcopy(model)
    plan = whole.choose(model, background=True).plan
    last = tiled_layers(model)[-1]                   # the background thread reaches it last
    x = torch.randn(3, last.in_features)
    out = []
    user = threading.Thread(target=lambda: out.append(last(x)))
    user.start()
    user.join(0.2)
    gate.set()
    user.join(60)
    plan.flat
    assert sorted(calls) == sorted({m.blocks.data_ptr() for m in tiled_layers(model)})
    assert torch.equal(out[0], tiled_layers(reference)[-1](x))


def test_pending_raises_in_every_waiter_and_reports_done():
    release = threading.Event()

    def work():
        release.wait(60)
        raise ValueError("planted")

    p = Pending(work, "a test")
    assert not p.done
    release.set()
    for _ in range(2):
        with pytest.raises(ValueError, match="planted"):
            p.wait()
    assert p.done and not p.succeeded


def test_open_model_chooses_at_once_and_leaves_only_the_tiles(smollm2):
    from tformer.inference import open_model

    opened = open_model(smollm2[0])
    plan = whole.chosen(opened.model).plan
    assert opened.path == "whole-layer" and "whole layers in one C++ call" in opened.path_reason
    assert len(plan.layers) == opened.model.config.n_layers and plan.ready
