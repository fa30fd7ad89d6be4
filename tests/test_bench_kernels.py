"""benchmarks/generate.py's "kernel" column is read from the modules set_precision installed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from generate import kernels_of  # noqa: E402

from tformer.config import TransformerConfig  # noqa: E402
from tformer.inference.quantize import set_precision  # noqa: E402
from tformer.models.decoder import DecoderLM  # noqa: E402


@pytest.mark.parametrize("precision,decode,expected", [
    ("fp32", True, "addmm(x, Wᵀ stored (K, N)) float32"), ("bf16", True, "torch.mv(W, x) bfloat16"),
    ("fp16", True, "F.linear float16"), ("int8", True, "_weight_int8pack_mm"),
    ("bf16", False, "F.linear (nn.Linear) bfloat16")])
def test_kernel_column_names_what_the_layers_run(precision, decode, expected):
    model = DecoderLM(TransformerConfig.from_name("tiny", vocab_size=64)).eval()
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    text = kernels_of(set_precision(model, precision, decode_kernels=decode))
    assert expected in text
    assert sum(int(part.split("x ", 1)[0]) for part in text.split("; ")) == n_linear   # every layer counted once
