"""llama.cpp through llama-cpp-python (the `bench` extra), on a GGUF that tformer exported.

Used by benchmarks/generation/generate.py (llama.cpp as a contender in the same run) and by
tests/interop/test_llama_cpp.py (llama.cpp's logits as an independent check of the exporter).
``llama_cpp`` is imported only when a :class:`LlamaCpp` is made, so this module imports without it. Token ids go in
and come out: tformer's exported models carry no llama.cpp tokenizer unless an HF byte-level BPE one
sits beside the weights, and ids are what both sides are compared on.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tformer.interop.gguf import save_gguf


def build_info() -> str:
    """Which llama.cpp this is: llama-cpp-python's version, where it was loaded from, and the SIMD
    features its CPU backend was compiled for (``llama_print_system_info``), for a benchmark's record:
    a build for AVX2 only and the default native build differ by as much as two CPUs do."""
    import llama_cpp

    features = llama_cpp.llama_print_system_info().decode().replace("CPU : ", "").strip(" |")
    return f"llama-cpp-python {llama_cpp.__version__} ({Path(llama_cpp.__file__).parent}), built for: {features}"


def export(model: torch.nn.Module, folder: Path, kinds: list[str], model_type: str | None = None) -> dict[str, Path]:
    """``model`` written as one GGUF per type in ``kinds`` (f32, f16, bf16, q8_0, q4_0): type -> path."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for kind in kinds:
        paths[kind] = folder / f"model-{kind}.gguf"
        save_gguf(model, paths[kind], kind, model_type=model_type)
    return paths


def ggml_gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU (tanh form) as ggml's CPU backend computes it: through a float16 table (GGML_GELU_FP16 in
    ggml-cpu/vec.h): the input rounded to float16, the table value rounded to float16; 0 below -10 and
    the identity above 10."""
    table = torch.nn.functional.gelu(x.half().float(), approximate="tanh").half().float()
    return torch.where(x <= -10, torch.zeros_like(x), torch.where(x >= 10, x, table))


def with_ggml_gelu(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose MLPs use :func:`ggml_gelu` (to tell the table's rounding from the export's)."""
    import copy

    twin = copy.deepcopy(model)
    for m in twin.modules():
        if type(m).__name__ == "MLP":
            m.act = ggml_gelu
    return twin


class LlamaCpp:
    """One llama.cpp model and context: ``logits(ids)`` for every position, ``generate(ids, n)`` greedy.

    Args:
        path: the GGUF file.
        n_ctx: context size to allocate (prompt + new tokens).
        threads: llama.cpp's threads for decode and prefill.
        logits_all: keep the logits of every position (for :meth:`logits`; a little slower).
        f32_cache: keys and values cached in float32 (llama.cpp's default is float16, which alone
            moves logits by ~1e-3; the exactness check needs float32, the speed runs keep the default).
        n_batch: tokens per llama.cpp batch (default: the whole prompt at once).
        repack: let llama.cpp repack weights into its CPU "extra buffer" layouts (AMX / interleaved
            rows; its default). ``False`` runs the ggml kernels on the weights as stored: needed for
            block-quantised files on this project's Xeon, where llama-cpp-python 0.3.36 crashes
            (SIGSEGV) with repacking on any batch of more than one token (SmolLM2's Q4_1 file).
    """

    def __init__(self, path: Path, n_ctx: int, threads: int = 2, logits_all: bool = False, f32_cache: bool = False,
                 n_batch: int | None = None, repack: bool = True):
        import llama_cpp
        import llama_cpp.llama as wrapper

        self.lib = llama_cpp
        cache = dict(type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32) if f32_cache else {}
        batch = n_batch or n_ctx
        default = llama_cpp.llama_model_default_params

        def params():                       # Llama() takes its model parameters from this function
            p = default()
            p.use_extra_bufts = repack
            return p

        wrapper.llama_cpp.llama_model_default_params = params
        try:
            self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=batch, n_ubatch=batch,
                                       n_threads=threads, n_threads_batch=threads, logits_all=logits_all,
                                       verbose=False, **cache)
        finally:
            wrapper.llama_cpp.llama_model_default_params = default
        self.vocab = self.llm.n_vocab()

    def _last_logits(self) -> np.ndarray:
        ptr = self.lib.llama_get_logits_ith(self.llm._ctx.ctx, -1)                 # the last evaluated row
        return np.ctypeslib.as_array(ptr, shape=(self.vocab,))

    def logits(self, ids: list[int]) -> np.ndarray:
        """``(T, vocab)`` float32 logits of every prompt position (needs ``logits_all=True``)."""
        self.llm.reset()
        self.llm.eval(ids)
        return np.array(self.llm.scores[:len(ids)], dtype=np.float32)

    def generate(self, ids: list[int], n: int) -> list[int]:
        """``n`` greedy tokens after ``ids`` (argmax of llama.cpp's logits, as tformer's temperature=0)."""
        self.llm.reset()
        self.llm.eval(ids)
        out = []
        for i in range(n):
            out.append(int(self._last_logits().argmax()))
            if i + 1 < n:
                self.llm.eval([out[-1]])
        return out
