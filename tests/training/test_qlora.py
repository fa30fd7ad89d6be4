"""QLoRA: LoRA over a frozen base kept in GGUF blocks (:mod:`tformer.quant.tiled`, ``LoRALinear`` over a
``BlockLinear``), against LoRA over the dequantised float base, the weights dequantised by ``gguf``'s own
``gguf.quants.dequantize`` (the independent reference), for every block format tformer keeps:

* the tiled product and its input gradient equal ``F.linear`` over the dequantised weight (1e-5 relative);
* on the same batch the LoRA parameters' gradients are within 1e-4 (relative to each gradient's largest
  entry) of LoRA over the float base, the loss within 1e-5; the blocks are untouched and get no gradient,
  and no float copy of a base matrix is held."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from test_shared_prefix import chat_batch, tiny
from tformer.quant import blocks
from tformer.quant.block_linear import BlockLinear, quantize_blocks, use_float_tiles
from tformer.quant.tiled import tiled_linear
from tformer.training.lora import LoRALinear, LoRASpec, add_lora
from tformer.training.shared_prefix import prefix_shared_loss

gguf = pytest.importorskip("gguf")
QT = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1"}


def gguf_dequantize(packed: torch.Tensor, fmt: str) -> torch.Tensor:
    qt = getattr(gguf.GGMLQuantizationType, QT[fmt])
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(packed.numpy(), qt))).float()


@pytest.mark.parametrize("fmt", blocks.FORMATS)
def test_tiled_product_and_input_gradient_equal_the_dequantised_linear(fmt):
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(200, 96, generator=g), torch.randn(200, generator=g)
    packed = blocks.quantize(w, fmt)
    ref_w = gguf_dequantize(packed, fmt)
    x = torch.randn(3, 5, 96, generator=g, requires_grad=True)
    y = tiled_linear(x, packed, fmt, b, tile_rows=64)                       # 4 tiles, the last one short
    gy = torch.randn(3, 5, 200, generator=g)
    (gx,) = torch.autograd.grad(y, x, gy)
    x_ref = x.detach().clone().requires_grad_()
    y_ref = nn.functional.linear(x_ref, ref_w, b)
    (gx_ref,) = torch.autograd.grad(y_ref, x_ref, gy)
    assert y.shape == (3, 5, 200)
    y, y_ref = y.detach(), y_ref.detach()
    assert torch.allclose(y, y_ref, rtol=1e-5, atol=1e-5 * float(y_ref.abs().max()))
    assert torch.allclose(gx, gx_ref, rtol=1e-5, atol=1e-5 * float(gx_ref.abs().max()))


def block_model(fmt: str, seed: int = 0):
    """A small Llama-layout decoder whose every linear is in ``fmt`` blocks (d_model 64: rows of 32s)."""
    model = tiny(seed, d_model=64, n_heads=4, n_kv_heads=2, d_ff=96, tie_embeddings=False)
    return quantize_blocks(model, fmt)


def float_copy(model):
    """The same model with every block layer an ``nn.Linear`` of gguf's dequantised weight."""
    ref = copy.deepcopy(model)
    for module in list(ref.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, BlockLinear):
                lin = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                with torch.no_grad():
                    lin.weight.copy_(gguf_dequantize(child.blocks, child.fmt))
                setattr(module, name, lin)
    return ref


def with_lora(model, seed=1):
    torch.manual_seed(seed)
    add_lora(model, LoRASpec(r=4, alpha=8, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                    "up_proj", "down_proj")))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for n, p in sorted(model.named_parameters()):
            if p.requires_grad:                     # B non-zero, so every adapter is seen by the loss
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


@pytest.mark.parametrize("fmt", blocks.FORMATS)
def test_lora_gradients_over_blocks_equal_lora_over_the_dequantised_base(fmt):
    base = block_model(fmt)
    ref = with_lora(float_copy(base)).train()
    qlora = base
    use_float_tiles(qlora)
    with_lora(qlora).train()
    kept = {n: b.clone() for n, b in qlora.named_buffers() if n.endswith("blocks")}
    ids, targets = chat_batch()

    def run(m, shared):
        loss = prefix_shared_loss(m, ids, targets) if shared else m(ids, targets, labelled_only=True)[1]
        loss.backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
        m.zero_grad(set_to_none=True)
        return float(loss.detach()), grads

    for shared in (False, True):
        (l0, g0), (l1, g1) = run(ref, shared), run(qlora, shared)
        assert l1 == pytest.approx(l0, rel=1e-5)
        assert g0.keys() == g1.keys() and len(g0) == 2 * 7 * len(qlora.blocks)     # A and B of 7 adapters
        for n in g0:
            assert ".lora_" in n
            assert float((g0[n] - g1[n]).abs().max()) <= 1e-4 * float(g0[n].abs().max()), (n, shared)
    for n, b in qlora.named_buffers():
        if n.endswith("blocks"):
            assert torch.equal(b, kept[n]) and b.dtype == torch.uint8 and not b.requires_grad
    sites = [m for m in qlora.modules() if isinstance(m, LoRALinear)]
    assert sites and all(m.weight is None and m.fmt == fmt for m in sites)
    big = [n for n, t in [*qlora.named_parameters(), *qlora.named_buffers()]
           if t.is_floating_point() and t.dim() == 2 and ".lora_" not in n and "emb" not in n and "rope" not in n]
    assert not big, big                                   # no float copy of a block matrix anywhere
