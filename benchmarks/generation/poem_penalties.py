"""Whether a penalty ends the README's greedy poem loop: `tformer chat` on SmolLM2 (its Q4_1 GGUF), greedy,
200 new tokens, plain and with `--frequency-penalty 0.5` and `--repetition-penalty 1.1`, each in a fresh
process; the transcripts and each answer's token count go in the result (no timing is compared).

    PYTHONPATH=src .venv/bin/python benchmarks/generation/poem_penalties.py

Writes benchmarks/results/generation/poem_penalties.md.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # benchmarks/, for common/
from common.record import Run, results_dir  # noqa: E402

BASE = ["chat", "--prompt", "Write a short poem about the sea.", "--temperature", "0", "--max-new-tokens", "200",
        "--threads", "2"]
VARIANTS = [[], ["--frequency-penalty", "0.5"], ["--repetition-penalty", "1.1"]]


def main() -> None:
    run = Run()
    lines = ["# A penalty ends the README's greedy poem loop", "",
             "SmolLM2-135M-Instruct (`smollm2`, its Q4_1 GGUF), greedy, at most 200 new tokens; the count is how "
             "many the answer took before its end-of-turn token (200: cut at the limit). Each heading is the "
             "command (`tformer` = `python -m tformer` with `PYTHONPATH=src`).", ""]
    for extra in VARIANTS:
        cmd = BASE + extra
        out = subprocess.run([sys.executable, "-m", "tformer", *cmd], capture_output=True, text=True, timeout=600)
        stats = out.stderr.strip().splitlines()[-1] if out.stderr.strip() else ""
        lines += [f"## `tformer {' '.join(repr(a) if ' ' in a else a for a in cmd)}`", "",
                  f"{stats.split(' in ')[0]} new", "", "```text", out.stdout.rstrip(), "```", ""]
    run.write(results_dir("generation") / "poem_penalties.md", "\n".join(lines))


if __name__ == "__main__":
    main()
