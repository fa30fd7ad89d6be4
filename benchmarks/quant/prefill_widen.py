"""Several-row products at bf16 / fp16: torch's kernel in that dtype against widening to float32 for
the product (``tformer.quant.kernels.PREFILL``), on this CPU as it is and with oneDNN and ATen held to
AVX2 (``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2``: the software path of a CPU without native
bf16 / fp16 arithmetic, such as the project's AMD EPYC; its vectors, not its cores).

The timed pass is what ``kernels.measure_prefill`` times when a machine chooses: M rows through two
pairs of GPT-2 124M's (768x3072, 3072x768) weights, the candidates alternated, medians of 7 rounds; each
ISA setting runs in a process of its own (the settings are read when torch loads). Criterion, stated
before the run: the choice ``choose_prefill`` makes is the faster candidate at 64 rows in each setting,
and where ``fp32`` is chosen it is >= 2x faster than ``native`` at 64-128 rows (the issue's bf16
prefill was 0.23x llama.cpp's on the EPYC).

    PYTHONPATH=src python benchmarks/quant/prefill_widen.py

Writes benchmarks/results/quant/prefill_widen.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.record import Run, results_dir  # noqa: E402

ROWS = (16, 64, 128)
SETTINGS = {"as it is": {}, "oneDNN + ATen at AVX2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}}


def child() -> None:
    import torch
    from tformer.quant import kernels
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    out = {kind: {rows: kernels.measure_prefill(kind, rows=rows, rounds=7) for rows in ROWS} for kind in kernels.PREFILL}
    print(json.dumps(out))


def main() -> None:
    if "--child" in sys.argv:
        return child()
    run = Run()
    got = {}
    for name, env in SETTINGS.items():
        p = subprocess.run([sys.executable, __file__, "--child"], env={**os.environ, **env, "THREADS": "2"},
                           capture_output=True, text=True, check=True)
        got[name] = json.loads(p.stdout.strip().splitlines()[-1])
        print(name, got[name], file=sys.stderr, flush=True)
    lines = ["# Several-row products at bf16 / fp16: in that dtype, or widened to float32", "",
             "M rows through 2 x (768x3072, 3072x768) weights, ms per pass (median of 7 alternated rounds), 2 threads; "
             "`native`: `F.linear` in the dtype; `fp32`: rows and weight widened, float32 `F.linear`, rounded back.", "",
             "| setting | dtype | rows | native ms | fp32 ms | fp32 / native | faster |", "|---|---|---:|---:|---:|---:|---|"]
    for name, kinds in got.items():
        for kind, by_rows in kinds.items():
            for rows, t in by_rows.items():
                lines.append(f"| {name} | {kind} | {rows} | {t['native'] * 1e3:.2f} | {t['fp32'] * 1e3:.2f} | "
                             f"{t['fp32'] / t['native']:.2f} | {min(t, key=t.get)} |")
    run.finish()
    print(run.write(results_dir("quant") / "prefill_widen.md", "\n".join(lines) + "\n").read_text())


if __name__ == "__main__":
    main()
