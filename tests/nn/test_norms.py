"""RMSNorm against transformers' own: Llama's (the normed vector rounded to the input's dtype, then times
``w``) and Gemma 3's (``unit_offset``: times ``1 + w`` in float32, then rounded), equal bit for bit in float32
and bfloat16; ``gain()`` is the factor both apply (``1 + w`` for Gemma's), what the fused plan reads."""

import pytest
import torch
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from tformer.nn.norms import RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_rmsnorm_equals_transformers(unit_offset, dtype):
    g = torch.Generator().manual_seed(3)
    ours = RMSNorm(64, eps=1e-6, unit_offset=unit_offset)
    theirs = Gemma3RMSNorm(64, eps=1e-6) if unit_offset else LlamaRMSNorm(64, eps=1e-6)
    w = torch.randn(64, generator=g) * 0.5                     # away from the init, signs mixed
    with torch.no_grad():
        ours.weight.copy_(w), theirs.weight.copy_(w)
    ours, theirs = ours.to(dtype), theirs.to(dtype)
    x = torch.randn(3, 5, 64, generator=g).to(dtype) * 4
    with torch.no_grad():
        assert torch.equal(ours(x), theirs(x))
    want = 1.0 + w.to(dtype).float() if unit_offset else w.to(dtype).float()
    assert ours.gain().dtype == torch.float32 and torch.equal(ours.gain(), want)
