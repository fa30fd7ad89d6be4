"""Block layers pass a gradient to their input (issue 49 item 10: the playground's attribution on block
weights): the backward of ``x Wᵀ`` is ``∂y · W`` with W the float weight the blocks stand for."""

import copy

import pytest
import torch

from quant_models import tiny
from tformer.quant.block_linear import BlockLinear
from tformer.quant.quantize import set_precision
from tformer.serve.inspect import input_x_gradient


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_a_block_layer_gives_its_input_the_float_weights_gradient(fmt, one_thread):
    torch.manual_seed(0)
    layer = BlockLinear.from_linear(torch.nn.Linear(64, 8), fmt)
    x = torch.randn(3, 64, requires_grad=True)
    g = torch.randn(3, 8)
    (grad,) = torch.autograd.grad((layer(x) * g).sum(), x)
    assert torch.allclose(grad, g @ layer.dequantized(), atol=1e-5)
    assert torch.equal(layer(x).detach(), layer.product(x.detach()))    # the autograd forward is the block product


def test_attribution_on_block_weights_matches_the_float_models(one_thread):
    model = tiny()
    blocky = set_precision(copy.deepcopy(model), "q8_0", decode_kernels=False)
    assert any(isinstance(m, BlockLinear) for m in blocky.modules())
    context = torch.tensor([3, 14, 15, 9, 26, 5])
    ref, ref_logp = input_x_gradient(model, context, 7)
    got, logp = input_x_gradient(blocky, context, 7)
    assert torch.allclose(got, ref, atol=0.05) and abs(logp - ref_logp) < 0.1, (got, ref)
