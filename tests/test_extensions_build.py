"""Every C++ kernel library builds on a machine that can build it.

A library that fails to build leaves ``None`` and torch's fallback (extensions.py), and the kernel
tests then skip: a syntax error in ``gemv.cpp`` once turned 16 of them into skips and the suite still
passed. Here a build failure on an x86 machine with a compiler, ninja and the flags the library needs
is a failure, with the compiler's reason.
"""

from __future__ import annotations

import os
import platform
import shutil

import pytest

from tformer.extensions import cpu_flags, find_ninja
from tformer.fused import library
from tformer.interop import gguf_strings
from tformer.ops import activation_cpu, attention_cpu
from tformer.quant import gemv, qgemv

LIBRARIES = {"quant/gemv.cpp": (gemv.load, gemv.STATUS, {"avx2", "fma", "f16c"}),
             "quant/qgemv.cpp": (qgemv.load, qgemv.STATUS, set()),
             "fused/layers.cpp": (library.load, library.STATUS, set()),
             "ops/attention_cpu.cpp": (attention_cpu.load, attention_cpu.STATUS, {"avx2", "fma"}),
             "ops/activation_cpu.cpp": (activation_cpu.load, activation_cpu.STATUS, {"avx2", "fma"}),
             "interop/gguf_strings.cpp": (gguf_strings.load, gguf_strings.STATUS, set())}


@pytest.mark.parametrize("source", list(LIBRARIES))
def test_each_kernel_library_builds_where_it_can(source):
    load, status, needs = LIBRARIES[source]
    if os.environ.get("TFORMER_NO_EXTENSION"):
        pytest.skip("TFORMER_NO_EXTENSION is set: the kernels are off by request")
    if platform.machine() not in ("x86_64", "AMD64") or not needs <= cpu_flags():
        pytest.skip(f"this CPU cannot run {source} ({platform.machine()}; needs {sorted(needs)})")
    if shutil.which(os.environ.get("CXX", "c++")) is None or find_ninja() is None:
        pytest.skip("no C++ compiler or no ninja here: torch's kernels stand in, by design")
    assert load() is not None, f"{source} did not build: {status.get('state')}"
