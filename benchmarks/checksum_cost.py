"""What verifying a weights checksum costs next to loading the weights (issue 18, item 5).

Writes one ~500 MB ``model.safetensors`` (a random fp32 tensor), then times, alternating the
contenders in each round so a busy machine hurts them alike:
    load      safetensors.torch.load_file (what tformer.checkpoint.load_model does)
    sha256    hashlib.sha256 over the file in 8 MiB chunks
    blake2b   hashlib.blake2b (64-byte digest) over the file in 8 MiB chunks
    isfinite  torch.isfinite(t).all() over the loaded tensor (the other load-time check)
The file stays in the page cache (read once before timing), so "load" is the fast case and the
ratio hash/load is the worst case for the hash. Medians of ``--rounds`` rounds; ratios to "load".

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/checksum_cost.py [--mb 500] [--rounds 5]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).parent))
from machine import busy_cores, load_note  # noqa: E402

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
    cpu = subprocess.run("lscpu | grep 'Model name'", shell=True, capture_output=True, text=True).stdout.split(":")[-1].strip()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.safetensors")
        save_file({"w": torch.randn(args.mb * (1 << 20) // 4)}, path)
        hash_file(path, "sha256")  # into the page cache
        before = busy_cores(1.0)
        times: dict[str, list[float]] = {k: [] for k in ("load", "sha256", "blake2b", "isfinite")}
        for _ in range(args.rounds):
            t = time.perf_counter(); state = load_file(path); times["load"].append(time.perf_counter() - t)
            t = time.perf_counter(); bool(torch.isfinite(state["w"]).all()); times["isfinite"].append(time.perf_counter() - t)
            del state
            for name in ("sha256", "blake2b"):
                t = time.perf_counter(); hash_file(path, name); times[name].append(time.perf_counter() - t)
        after = busy_cores(1.0)
        size = os.path.getsize(path)
    med = {k: statistics.median(v) for k, v in times.items()}
    lines = [f"# Checksum cost on a {size / 1e6:.0f} MB safetensors file", "",
             f"CPU: {cpu}; torch {torch.__version__}; {torch.get_num_threads()} thread(s); "
             f"{args.rounds} rounds, contenders alternated; medians.",
             f"Load before: {load_note(before)}. After: {load_note(after)}.", "",
             "| step | median s | MB/s | ratio to load |", "|---|---|---|---|"]
    for k, v in med.items():
        lines.append(f"| {k} | {v:.3f} | {size / 1e6 / v:,.0f} | {v / med['load']:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(__file__).parent / "results" / "checksum_cost.md"
    out.write_text(text)


if __name__ == "__main__":
    main()
