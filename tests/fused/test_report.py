"""The benchmarks' "kernel" column (tformer.fused.report.kernels_of) is read from the modules
set_precision installed, and from the model's whole-layer choice."""

from __future__ import annotations

import pytest
import torch

from tformer.config import TransformerConfig
from tformer.models.decoder import DecoderLM
import tformer.fused as whole
from tformer.fused.report import kernels_of
from tformer.quant.quantize import set_precision


NAMES = {"ext": "tformer GEMV", "mv": "torch.mv(W, x)", "linear": "F.linear", "mm_t": "torch.addmm",
         "int8pack": "_weight_int8pack_mm", "int4pack": "_weight_int4pack_mm_for_cpu"}


@pytest.mark.parametrize("precision,decode", [("fp32", True), ("bf16", True), ("fp16", True), ("int8", True),
                                              ("int4", True), ("bf16", False), ("q8_0", True)])
def test_kernel_column_names_what_the_layers_run(precision, decode):
    model = DecoderLM(TransformerConfig.from_name("tiny", vocab_size=64)).eval()
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    model = set_precision(model, precision, decode_kernels=decode)
    text = kernels_of(model)
    chosen = {m.kernel for m in model.modules() if hasattr(m, "kernel")}
    if precision == "q8_0":
        assert "block products" in text and "q8_0" in text           # BlockLinear: no kernel to choose
    elif decode:
        assert chosen and all(NAMES[k] in text for k in chosen)       # the kernel each layer chose, by name
    else:
        assert not chosen and "F.linear (nn.Linear) bfloat16" in text
    parts = text.split("; ")
    fused = whole.chosen(model).plan is not None                      # calls take whole layers in one C++ call
    assert parts[0].startswith("decode: 4 layers, whole layers in one C++ call") == fused and (fused or precision in ("int8", "int4") or not decode)
    parts = parts[1:] if fused else parts
    assert sum(int(part.split("x ", 1)[0]) for part in parts) == n_linear   # every layer counted once
