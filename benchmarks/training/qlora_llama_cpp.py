"""A merged QLoRA model's GGUF (``tformer finetune --merge``'s ``merged.gguf``) in llama.cpp against tformer:
greedy answers to held-out questions of the built-in task, the same prompt tokens on both sides.

tformer opens the file as ``tformer chat`` would (its blocks, multiplied as stored); llama.cpp's Python
binding (``llama_cpp``) loads the same file and samples greedily (top-k 1) from the same prompt token ids
(the chat template rendered by tformer, as in training), both stopping at the template's end-of-turn token.
The answers are compared as text (both decoded by the file's tokenizer).

    PYTHONPATH=src:/work/llama_native python benchmarks/training/qlora_llama_cpp.py --gguf RUN/merged.gguf
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.record import Run  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", required=True, help="the merged model's GGUF file")
    p.add_argument("--base", default="smollm2", help="the base model whose template and tokenizer the run used")
    p.add_argument("--n", type=int, default=10, help="held-out questions")
    p.add_argument("--n-train", type=int, default=900)
    p.add_argument("--n-test", type=int, default=50)
    p.add_argument("--max-number", type=int, default=999)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tag", default="")
    a = p.parse_args()
    import llama_cpp
    from tformer.inference import open_model
    from tformer.training.chat_data import number_task
    from tformer.training.finetune import load_base, prompt_ids
    from tformer.training.tasks.finetune import answers

    run = Run()
    torch.set_num_threads(a.threads)
    _, tokenizer, template, stops = load_base(a.base, blocks=True)
    _, test = number_task(a.n_train, a.n_test, a.max_number, 0)
    questions = [(prompt_ids(template, c[:1], tokenizer), c[1]["content"]) for c in test[:a.n]]
    opened = open_model(a.gguf, threads=a.threads)
    ours = answers(opened.model, [q for q, _ in questions], stops, tokenizer.decode, stops[0], "cpu")
    llm = llama_cpp.Llama(model_path=a.gguf, n_ctx=256, n_threads=a.threads, verbose=False, logits_all=False)
    theirs = []
    for prompt, _ in questions:
        llm.reset()
        out = []
        for tok in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0):
            if tok in stops or len(out) >= 48:
                break
            out.append(tok)
        theirs.append(tokenizer.decode(out).strip())
    llm.close()
    run.finish()
    same = sum(x == y for x, y in zip(ours, theirs))
    right = sum(x == ref for x, (_, ref) in zip(ours, questions))
    lines = [f"# The merged QLoRA model's GGUF in llama.cpp against tformer ({Path(a.gguf).name})", "",
             f"{a.gguf} ({opened.dtype}: {opened.dtype_reason}); {len(questions)} held-out questions of the built-in task; "
             f"greedy on both sides from the same prompt tokens; llama-cpp-python {llama_cpp.__version__}.", "",
             f"**Greedy answers equal: {same} of {len(questions)}**; tformer's answers right: {right} of {len(questions)}.", "",
             "| question | reference | tformer | llama.cpp | equal |", "|---|---|---|---|---|"]
    for (prompt, ref), x, y, c in zip(questions, ours, theirs, test):
        lines.append(f"| {c[0]['content']} | {ref} | {x} | {y} | {'yes' if x == y else 'no'} |")
    run.write_result("training", "qlora_llama_cpp", a.tag, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
