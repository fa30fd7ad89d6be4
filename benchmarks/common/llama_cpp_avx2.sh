#!/usr/bin/env bash
# llama.cpp (llama-cpp-python) built for AVX2 only, into a folder of its own, so that on a CPU with
# AVX-512 / VNNI / AMX the decode benchmarks can run llama.cpp on the code an AVX2-only CPU (e.g. AMD
# Zen 3) runs, against tformer held to AVX2 in the same process:
#
#   bash benchmarks/common/llama_cpp_avx2.sh /tmp/llama_avx2          # ~10 min on 2 cores
#   PYTHONPATH=/tmp/llama_avx2:src ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 \
#     MKL_ENABLE_INSTRUCTIONS=AVX2 TFORMER_QGEMV_PATH=avx2 TFORMER_GEMV_PATH=avx2 \
#     python benchmarks/generation/generate.py ...
#
# The benchmarks record which build they loaded (tformer.interop.llama_cpp.build_info). The version is
# the one the bench extra pins in practice (0.3.36); pip fetches its sdist from PyPI.
set -euo pipefail
target=${1:?usage: llama_cpp_avx2.sh TARGET_DIR}
python=${PYTHON:-python}
off="-DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF"
off="$off -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON $off
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
  "$python" -m pip install --no-deps --no-binary llama-cpp-python --target "$target" "llama-cpp-python==${LLAMA_CPP_VERSION:-0.3.36}"
# Its one requirement that a dev venv may lack (numpy, jinja2 and typing-extensions come with torch and tformer):
# pure Python, into the same folder, so the folder works first on any venv's PYTHONPATH.
"$python" -m pip install --no-deps --target "$target" "diskcache>=5.6"
PYTHONPATH="$target" "$python" -c "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"
