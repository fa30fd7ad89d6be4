"""The first prompt of a fresh process against the next ones, on a GGUF file opened at ``--dtype auto``: what
``kquant_llama_cpp.py``'s prefill (the first prompt after ``open_model``) holds besides the products.

Per fresh process (``--processes``): ``open_model``, then three prompts of ``--prompt`` random ids, each into a
new state; per prompt its seconds, the time inside the product loops (``tformer_fused::product_ns`` +
``tformer_qgemv::product_ns``), its minor page faults and user / system CPU seconds (``getrusage``).

    flock /tmp/tformer-bench.lock env PYTHONPATH=src .venv/bin/python benchmarks/quant/first_prompt.py \\
        --files /tmp/kq/qwen05-q4_k_m.gguf /tmp/kq/qwen05-q6_k.gguf --tag s5

Writes benchmarks/results/quant/first_prompt[-TAG].md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # benchmarks/, for common/
from common.record import Run  # noqa: E402

CHILD = """
import json, resource, sys, time, torch
from tformer.generation.step import prefill
from tformer.inference import open_model
path, threads, prompt, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
t = time.perf_counter()
model = open_model(path, threads=threads).model
out = {"open": time.perf_counter() - t, "calls": []}
ids = torch.randint(100, 30000, (1, prompt), generator=torch.Generator().manual_seed(seed))
with torch.inference_mode():
    for _ in range(3):
        state = model.new_state(1, prompt + 8)
        torch.ops.tformer_fused.product_ns(True), torch.ops.tformer_qgemv.product_ns(True)
        a, t = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        prefill(model, ids, state)
        s, b = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF)
        ns = torch.ops.tformer_fused.product_ns(True) + torch.ops.tformer_qgemv.product_ns(True)
        out["calls"].append({"s": s, "products": ns * 1e-9, "faults": b.ru_minflt - a.ru_minflt,
                             "user": b.ru_utime - a.ru_utime, "sys": b.ru_stime - a.ru_stime})
print(json.dumps(out))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", nargs="+", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--processes", type=int, default=3)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    run = Run()
    lines = ["# The first prompt of a fresh process against the next ones", "",
             f"{args.prompt} random ids, {args.threads} thread(s); per prompt: seconds, seconds in the products, "
             "minor page faults, user / system CPU seconds.", "",
             "| file | process | open s | prompt | s | products s | faults | user s | sys s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for path in args.files:
        for p in range(args.processes):
            r = subprocess.run([sys.executable, "-c", CHILD, str(path), str(args.threads), str(args.prompt), str(p)],
                               capture_output=True, text=True, check=True)
            got = json.loads(r.stdout.strip().splitlines()[-1])
            for i, c in enumerate(got["calls"]):
                lines.append(f"| {path.name} | {p + 1} | {got['open']:.2f} | {i + 1} | {c['s']:.3f} | {c['products']:.3f} | "
                             f"{c['faults']} | {c['user']:.3f} | {c['sys']:.3f} |")
                print(lines[-1], flush=True)
    run.finish()
    print(run.write_result("quant", "first_prompt", args.tag, "\n".join(lines) + "\n").read_text())


if __name__ == "__main__":
    main()
