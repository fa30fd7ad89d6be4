"""The model families (Llama 3.2 and 3.1 with llama3 RoPE, Qwen3, Qwen2.5 with YaRN, Gemma 2, Gemma 3, Phi-3.5 with
LongRoPE) at their published configurations cut to 2 layers (the test fixtures, tests/interop/families.py):
tformer's float32 logits from the HF folder against transformers (its RoPE angles in float64, and as it computes them, in float32), and
from a float32 GGUF written by the ``gguf`` package against llama.cpp (llama-cpp-python, float32 cache).
Each figure is the largest difference over the five prompts (one past ``original_max_position_embeddings``
for transformers; for Gemma 3 a sixth of 600 tokens, past its 512-token window) relative to the logits' largest
magnitude.

Result: benchmarks/results/interop/families_parity.md, with the run's record (common/record.py).

    export PYTHONPATH=$PWD/src:$PWD/tests/interop:/work/llama_native
    flock -w 900 /tmp/tformer-bench.lock timeout 600 .venv/bin/python benchmarks/interop/families_parity.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # benchmarks/, for common/
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "interop"))
from common.record import Run, results_dir  # noqa: E402

import families as F  # noqa: E402

OUT = results_dir("interop") / "families_parity.md"
# families without the llama.cpp column, and why
NO_LLAMA_CPP = {"llama-3.1-8b": "the 8B cut shares Llama 3.2's layout"}


def transformers_figures(family: str, folder: Path) -> tuple[float, float]:
    import transformers

    from tformer.interop.hf import load_hf

    exact = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    own = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    F.float64_angles(exact)
    ours = load_hf(folder)
    pos = F.far_positions((ours.config.rope_scaling or {}).get("original_max_position_embeddings", 8192))[None]
    cases = [(torch.tensor([i]), None) for i in F.prompts()] + [(torch.tensor([F.prompts()[3][:pos.shape[1]]]), pos)]
    if (ours.config.sliding_window or 10**9) < 600:        # Gemma 3's window (512): a prompt past it
        ids = torch.randint(0, F.VOCAB - len(F.SPECIAL) - 1, (1, 600), generator=torch.Generator().manual_seed(1))
        cases.append((ids, None))
    a = b = 0.0
    with torch.no_grad():
        for x, p in cases:
            logits = ours(x, positions=p)[0]
            a = max(a, F.relative(logits, exact(x, position_ids=p).logits))
            b = max(b, F.relative(logits, own(x, position_ids=p).logits))
    return a, b


def llama_cpp_figure(family: str, folder: Path) -> float | None:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return None
    from tformer.interop.gguf_import import load_gguf
    from tformer.interop.llama_cpp import LlamaCpp

    path = F.write_gguf(family, F.hf_model(family, gguf_layout=True), folder / "f32.gguf", "f32")
    model, worst = load_gguf(path), 0.0
    for ids in F.prompts():
        cpp = LlamaCpp(path, n_ctx=len(ids) + 8, threads=2, logits_all=True, f32_cache=True)
        with torch.no_grad():
            worst = max(worst, F.relative(model(torch.tensor([ids]))[0][0], torch.from_numpy(cpp.logits(ids))))
    return worst


def main() -> None:
    run = Run()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in F.PUBLISHED:
            folder = F.hf_folder(family, Path(tmp) / family)
            exact, own = transformers_figures(family, folder)
            cpp = llama_cpp_figure(family, folder) if family not in NO_LLAMA_CPP else None
            rows.append(f"| {family} | {exact:.1e} | {own:.1e} | {'—' if cpp is None else f'{cpp:.1e}'} |")
            print(rows[-1], flush=True)
    run.finish()
    run.write(OUT, "\n".join([
        "# The model families against transformers and llama.cpp (2 layers, published shapes, random weights)", "",
        "| family | vs transformers, float64 angles | vs transformers' float32 angles | f32 GGUF vs llama.cpp |",
        "|---|---:|---:|---:|", *rows, "",
        "Largest |Δ logit| over the prompts / largest |logit|; llama.cpp on four prompts (its batch takes "
        "consecutive positions only), '—' where not run: "
        + "; ".join(f"{k}, {why}" for k, why in NO_LLAMA_CPP.items()) + "."]))


if __name__ == "__main__":
    main()
