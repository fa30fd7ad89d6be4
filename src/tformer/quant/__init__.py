"""Lower-precision weights and the decode kernels that read them: ``set_precision`` (``quantize``; also
``tformer.set_precision``), float GEMV / GEMM (``gemv``), GGUF's block formats (``blocks``,
``block_linear``, ``block_embedding``) and their integer kernels (``qgemv``), the per-machine kernel
choice (``kernels``), and the interleaved tiles (``tiles.h``) that whole decoder layers in one C++ call
(:mod:`tformer.fused`) share with ``qgemv``. Nothing is re-exported: import from the module."""
