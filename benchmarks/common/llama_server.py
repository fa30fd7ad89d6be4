"""``python -m llama_cpp.server`` with ggml's extra weight buffers off, for benchmarks/serving/serve_gguf.py.

On this CPU (AMX-INT8) the llama-cpp-python build here (0.3.x from PyPI) stops with a general
protection fault in libggml-cpu on the first batch of more than one token when it repacks 4-bit
weights into its extra (AMX / repacked) buffers, which it does by default; the server then drops
every request. With ``use_extra_bufts = False`` (llama.cpp's ``--no-repack``) it runs; it then
multiplies the GGUF's blocks as stored, with its AVX-512 kernels. Arguments: those of
``llama_cpp.server``.
"""

import llama_cpp
import llama_cpp.llama

_default = llama_cpp.llama_model_default_params


def _no_extra_buffers():
    params = _default()
    params.use_extra_bufts = False
    return params


llama_cpp.llama.llama_cpp.llama_model_default_params = _no_extra_buffers

if __name__ == "__main__":
    from llama_cpp.server.__main__ import main

    main()
