"""What verifying a weights checksum costs next to loading the weights (issue 18, item 5).

Part 1 (the hash): writes one ~500 MB ``model.safetensors`` (a random fp32 tensor) and times,
alternating the contenders in each round so a busy machine hurts them alike:
    load_file   safetensors.torch.load_file alone (memory-mapped: it reads almost nothing yet)
    sha256      hashlib.sha256 over the file in 8 MiB chunks
    blake2b     hashlib.blake2b (32-byte digest) over the file in 8 MiB chunks
    isfinite    torch.isfinite(t).all() over the tensor (exact, allocates a bool tensor)
    sum         torch.isfinite(t.sum()) (what tformer's check_finite does first)
Part 2 (what a user waits for): saves the gpt2-124m preset (~500 MB fp32) with save_model and times
load_model(verify=False) against load_model(verify=True), alternated. The files stay in the page
cache (read once before timing): the fast case, so the ratio is the worst case for the checks.

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/training/checksum_cost.py [--mb 500] [--rounds 5]

Writes benchmarks/results/training/checksum_cost.md.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # benchmarks/, for common/
from common.record import Run, load_note, results_dir  # noqa: E402
from tformer.machine import busy_cores  # noqa: E402

CHUNK = 8 << 20


def hash_file(path: str, name: str) -> str:
    h = hashlib.new(name) if name != "blake2b" else hashlib.blake2b(digest_size=32)
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    run = Run(measure_load=False)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.safetensors")
        save_file({"w": torch.randn(args.mb * (1 << 20) // 4)}, path)
        hash_file(path, "sha256")  # into the page cache
        before = busy_cores(1.0)
        times: dict[str, list[float]] = {k: [] for k in ("load_file", "sha256", "blake2b", "isfinite", "sum")}
        for _ in range(args.rounds):
            t = time.perf_counter(); state = load_file(path); times["load_file"].append(time.perf_counter() - t)
            t = time.perf_counter(); bool(torch.isfinite(state["w"]).all()); times["isfinite"].append(time.perf_counter() - t)
            t = time.perf_counter(); bool(torch.isfinite(state["w"].sum())); times["sum"].append(time.perf_counter() - t)
            del state
            for name in ("sha256", "blake2b"):
                t = time.perf_counter(); hash_file(path, name); times[name].append(time.perf_counter() - t)
        size = os.path.getsize(path)
        os.unlink(path)
        from tformer import DecoderLM, TransformerConfig
        from tformer.checkpoint import load_model, save_model
        save_model(os.path.join(tmp, "m"), DecoderLM(TransformerConfig.from_name("gpt2-124m")))
        msize = os.path.getsize(os.path.join(tmp, "m", "model.safetensors"))
        hash_file(os.path.join(tmp, "m", "model.safetensors"), "sha256")
        full: dict[str, list[float]] = {"load_model(verify=False)": [], "load_model(verify=True)": []}
        for _ in range(max(3, args.rounds // 2)):
            for verify in (False, True):
                t = time.perf_counter(); load_model(os.path.join(tmp, "m"), verify=verify)
                full[f"load_model(verify={verify})"].append(time.perf_counter() - t)
        after = busy_cores(1.0)
        run.busy_before = before
        run.finish(after)
    med = {k: statistics.median(v) for k, v in times.items()}
    fmed = {k: statistics.median(v) for k, v in full.items()}
    lines = [f"# Checksum cost on a {size / 1e6:.0f} MB safetensors file", "",
             f"{args.rounds} rounds, contenders alternated; medians (the load was measured after the file was "
             "written and cached, and after the last round).", "",
             "| step (one fp32 tensor) | median s | MB/s | ratio to sha256 |", "|---|---|---|---|"]
    for k, v in med.items():
        lines.append(f"| {k} | {v:.3f} | {size / 1e6 / v:,.0f} | {v / med['sha256']:.2f} |")
    lines += ["", f"gpt2-124m checkpoint, {msize / 1e6:.0f} MB:", "",
              "| load | median s | ratio to verify=False |", "|---|---|---|"]
    for k, v in fmed.items():
        lines.append(f"| {k} | {v:.3f} | {v / fmed['load_model(verify=False)']:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    run.write(results_dir("training") / "checksum_cost.md", text)


if __name__ == "__main__":
    main()
