"""Where opening SmolLM2's Q4_1 GGUF goes: ``open_model("smollm2")`` in fresh processes, timed phase by phase.

Each run is a fresh interpreter (torch and tformer imported before the clock, Python's bytecode cached by
one untimed run first, a fresh cache holding only the built kernels: what a first start after `make
install` finds). The phases are the loader's own functions, each wrapped to add up the process's CPU time
inside it (``time.process_time``: both torch threads, so a parallel region's wait shows too) and its wall
time; a phase nested in another is counted in both (the table indents it). The whole open is timed the
same way. Medians over the runs; the minimum beside them, since a busy neighbour only adds.

    flock /tmp/tformer-bench.gate flock /tmp/tformer-bench.lock env PYTHONPATH=src \\
        .venv/bin/python benchmarks/generation/open_profile.py --runs 9 --tag epyc

Writes benchmarks/results/generation/open_profile[-TAG].md and .json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # benchmarks/, for common/
from common.first_start import first_start_env  # noqa: E402
from common.record import Run  # noqa: E402

# (depth, module, function, what it is): the loader's phases, in the order they run
PHASES = [
    (0, "tformer.interop.gguf_reader", "GGUFFile.__init__", "the header: metadata and tensor table"),
    (1, "tformer.interop.gguf_reader", "_Cursor.strings", "its string arrays (tokens, merges)"),
    (0, "tformer.interop.gguf_import", "load_gguf_file", "the model from the file's blocks"),
    (1, "tformer.interop.gguf_import", "hf_tensors", "the tensors as views of the file, q and k reordered"),
    (2, "tformer.interop.gguf_import", "check_finite", "every block's scales finite"),
    (1, "tformer.interop.llama", "state_from_hf", "q, k and v joined"),
    (1, "tformer.interop.hf", "build_model", "the modules, weights uninitialised"),
    (1, "tformer.interop.gguf_import", "install_blocks", "block modules in place of the linears"),
    (0, "tformer.quant.quantize", "set_precision", "the float layers' kernels"),
    (0, "tformer.interop.gguf_import", "gguf_tokenizer", "the vocabulary as a tokenizers BPE"),
    (1, "tformer.tokenizers", "checked_gguf_tokens", "the tokens' checks and their ids"),
    (1, "tformer.tokenizers", "gguf_special_tokens", "control and user tokens, bos / eos"),
    (0, "tformer.tokenizers", "ChatTemplate.__init__", "the chat template (jinja2 imported, parsed)"),
    (0, "tformer.inference", "choose_path", "the whole-layer plan (its tiles begun on a second thread)"),
    (1, "tformer.fused.plan", "why_not", "the model's checks and the kernels' libraries loaded"),
    (1, "tformer.fused.plan", "Plan.__init__", "what the plan decides, the tiles' thread started"),
    (0, "tformer.quant.qgemv", "tiles", "(second thread, beside the above) the block matrices repacked into tiles"),
]
# the whole open's rows, timed by the child itself
OPEN = [(0, "open_model", "the whole open"), (1, "open_model system", "its system (kernel) CPU time, getrusage"),
        (0, "first use wait", "(after the open) the first use's wait for the tiles, were it at once"),
        (0, "open + first use", "the open and that wait")]
CHILD = """
import functools, importlib, json, resource, sys, time
import torch
import tformer.cli, tformer.inference as inference
phases, spent = json.loads(sys.argv[1]), {}
def wrap(module, qualname):
    owner = importlib.import_module(module)
    parts = qualname.split(".")
    for part in parts[:-1]:
        owner = getattr(owner, part)
    fn = getattr(owner, parts[-1])
    @functools.wraps(fn)
    def timed(*args, **kwargs):
        c, w = time.process_time(), time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            cpu, wall = spent.get(qualname, (0.0, 0.0))
            spent[qualname] = (cpu + time.process_time() - c, wall + time.perf_counter() - w)
    setattr(owner, parts[-1], timed)
for _, module, qualname, _ in phases:
    wrap(module, qualname)
def system():
    return resource.getrusage(resource.RUSAGE_SELF).ru_stime
c, w, s = time.process_time(), time.perf_counter(), system()
opened = inference.open_model("smollm2")
spent["open_model"] = (time.process_time() - c, time.perf_counter() - w)
spent["open_model system"] = (system() - s, 0.0)
from tformer.fused import chosen
c2, w2 = time.process_time(), time.perf_counter()
chosen(opened.model).plan.flat     # what the first prefill or step waits for (the plan's tiles)
spent["first use wait"] = (time.process_time() - c2, time.perf_counter() - w2)
spent["open + first use"] = (time.process_time() - c, time.perf_counter() - w)
print(json.dumps(spent))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    run = Run()
    env, _ = first_start_env("tformer-open-profile-")

    def child() -> dict:
        r = subprocess.run([sys.executable, "-c", CHILD, json.dumps(PHASES)], capture_output=True, text=True,
                           env=env, check=False)
        if r.returncode:
            raise SystemExit(f"open_profile: a run failed:\n{r.stderr[-3000:]}")
        return json.loads(r.stdout.strip().splitlines()[-1])

    child()                                                   # untimed: writes the bytecode
    runs = [child() for _ in range(args.runs)]
    rows = OPEN + [(d, q, what) for d, _, q, what in PHASES]

    def stat(name, i, f):
        return f(r.get(name, (0.0, 0.0))[i] for r in runs)

    lines = ["# Where opening SmolLM2-135M-Instruct's Q4_1 GGUF goes, phase by phase", "",
             f"{args.runs} fresh processes, `open_model(\"smollm2\")` after the imports; CPU = the process's CPU "
             f"time inside the phase (every thread: a phase beside the tiles' thread counts its CPU too), wall = its "
             f"clock time; a nested phase (indented) is counted in its parent too; the tiles are made on a second "
             f"thread, so their row overlaps the phases after the plan.", "",
             "| phase | what | CPU ms (median) | CPU ms (min) | wall ms (median) |", "|---|---|---:|---:|---:|"]
    for depth, name, what in rows:
        lines.append(f"| {'· ' * depth}`{name}` | {what} | {stat(name, 0, statistics.median) * 1e3:.1f} | "
                     f"{stat(name, 0, min) * 1e3:.1f} | {stat(name, 1, statistics.median) * 1e3:.1f} |")
    run.write_result("generation", "open_profile", args.tag, "\n".join(lines) + "\n", {"runs": runs})
    print("\n".join(lines))


if __name__ == "__main__":
    main()
