"""lm-eval three ways on the same weights: its own `hf` backend (transformers), `tformer eval`'s native model
class, and `lm_eval --model local-completions` against `tformer serve` (echo + logprobs); per-document
log-likelihoods compared, accuracy and throughput of each.

SmolLM2-135M-Instruct: the built-in GGUF, imported to float32 (`tformer convert --from-gguf`) and exported
to a HuggingFace folder (`tformer convert --to-hf`), so all three read the same float32 weights
(tformer at `--dtype fp32`). Task: tformer_arith (50 four-way questions, src/tformer/evaluation/tasks).
Goal (issue 53, stated before the run): every per-choice log-likelihood within 1e-3 of the hf backend's
and identical accuracy.

    flock /tmp/tformer-bench.lock env PYTHONPATH=src .venv/bin/python benchmarks/serving/lm_eval_check.py

Writes benchmarks/results/serving/lm_eval_check.md and .json.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # benchmarks/, for common/
from common.http_server import start as start_server  # noqa: E402
from common.record import Run, results_dir  # noqa: E402

TASK, BATCH, THREADS = "tformer_arith", 16, 2
ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "src" / "tformer" / "evaluation" / "tasks"


def export(tmp: Path) -> Path:
    """The GGUF's weights as a float32 HF folder (with tokenizer.json), through tformer's converters."""
    from tformer.interop.builtin import builtin_path

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    for argv in (["--from-gguf", str(builtin_path("smollm2")), "--out", str(tmp / "ckpt")],
                 ["--to-hf", str(tmp / "ckpt"), "--out", str(tmp / "hf")]):
        subprocess.run([sys.executable, "-m", "tformer", "convert", *argv], env=env, check=True,
                       stdout=subprocess.DEVNULL)
    return tmp / "hf"


def per_doc(results) -> dict[int, list[float]]:
    return {s["doc_id"]: [float(r[0]) for r in s["filtered_resps"]] for s in results["samples"][TASK]}


def evaluate(model, model_args: str | None = None) -> tuple[dict, float]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    start = time.perf_counter()
    res = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[TASK], batch_size=BATCH,
                                  task_manager=TaskManager(include_path=[str(TASKS)]), log_samples=True)
    return res, time.perf_counter() - start


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(port: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, "-m", "tformer", "serve", "--model", "smollm2", "--dtype", "fp32", "--port", str(port),
           "--threads", str(THREADS), "--slots", str(BATCH), "--max-model-len", "512"]
    return start_server(cmd, port, env, timeout_s=300)


def main() -> None:
    import torch

    from tformer.evaluation.harness import TformerLM
    from tformer.inference import open_model

    run = Run()
    torch.set_num_threads(THREADS)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        hf = export(Path(tmp))
        from lm_eval.models.huggingface import HFLM

        res, secs = evaluate(HFLM(pretrained=str(hf), dtype="float32", device="cpu", batch_size=BATCH))
        out["hf"] = (res, secs)
        res, secs = evaluate(TformerLM(open_model("smollm2", "fp32"), batch_size=BATCH))
        out["tformer eval"] = (res, secs)
        port = free_port()
        proc = serve(port)
        try:
            res, secs = evaluate("local-completions",
                                 f"model=smollm2,base_url=http://127.0.0.1:{port}/v1/completions,tokenizer={hf},"
                                 f"tokenized_requests=True,num_concurrent=1,max_retries=1")
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        out["local-completions -> tformer serve"] = (res, secs)
    ref = per_doc(out["hf"][0])
    n_requests = sum(len(v) for v in ref.values())
    lines = ["# lm-eval on the same weights: hf backend, `tformer eval`, local-completions against `tformer serve`", "",
             f"SmolLM2-135M-Instruct in float32 (the built-in GGUF imported, exported with `tformer convert --to-hf` "
             f"for the hf backend), task {TASK} ({len(ref)} documents, {n_requests} loglikelihood requests), batch "
             f"{BATCH}, {THREADS} threads. Goal: every per-choice log-likelihood within 1e-3 of the hf backend's, the "
             f"same accuracy.", "",
             "| backend | accuracy | max abs diff of a log-likelihood from hf | requests/s | seconds |",
             "|---|---:|---:|---:|---:|"]
    summary = {}
    for name, (res, secs) in out.items():
        docs = per_doc(res)
        diff = max(abs(a - b) for d in ref for a, b in zip(ref[d], docs[d]))
        acc = res["results"][TASK]["acc,none"]
        summary[name] = {"acc": acc, "max_abs_diff": diff, "seconds": secs, "requests_per_s": n_requests / secs,
                         "loglikelihoods": {str(d): v for d, v in sorted(docs.items())}}
        lines.append(f"| {name} | {acc:.2f} | {diff:.2e} | {n_requests / secs:.1f} | {secs:.1f} |")
    same_acc = len({round(v["acc"], 9) for v in summary.values()}) == 1
    worst = max(v["max_abs_diff"] for v in summary.values())
    lines += ["", f"Goal {'met' if same_acc and worst <= 1e-3 else 'MISSED'}: largest difference {worst:.2e}, "
                  f"accuracy {'identical' if same_acc else 'different'}. Seconds: simple_evaluate with the model already "
                  f"loaded (the server already up), so lm-eval's own work (tokenizing, building requests) is in each "
                  f"row; local-completions sends one batch of {BATCH} prompts per HTTP request."]
    folder = results_dir("serving")
    run.write(folder / "lm_eval_check.md", "\n".join(lines) + "\n")
    run.write_json(folder / "lm_eval_check.json", summary)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
