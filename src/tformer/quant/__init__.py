"""Lower-precision weights and the decode kernels that read them: ``set_precision`` (``quantize``; also
``tformer.set_precision``), float GEMV / GEMM (``gemv``), GGUF's block formats (``blocks``,
``block_linear``, ``block_embedding``) and their integer kernels (``qgemv``), the per-machine kernel
choice (``kernels``) and whole decoder layers in one C++ call (``fused_decode``). Nothing is
re-exported: import from the module."""
