"""An IsoFLOP sweep of tiny models on the built-in corpus, with our fitted exponents beside the papers'.

    env PYTHONPATH=src python benchmarks/scaling/scaling_sweep.py [--out runs/sweep-cpu] [--budgets 1e10,3e10,1e11]

Runs (or continues: the sweep is resumable) ``tformer sweep`` with its defaults (``DEFAULT`` in
tformer/commands/sweep.py) and one thread per run, then writes
benchmarks/results/scaling/scaling_sweep.md and copies the two plots there as scaling_isoflop.png and
scaling_fits.png. Tiny models need far more tokens per parameter and a higher learning rate than
Chinchilla's, hence DEFAULT's 100 tokens per parameter and lr 3e-3.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from tformer.cli import main as tformer
from tformer.commands.sweep import DEFAULT
from tformer.scaling.report import fit_rows

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # benchmarks/, for common/
from common.record import Run, results_dir  # noqa: E402

RESULTS = results_dir("scaling")


def table(fits: dict, runs: list[dict]) -> str:
    rows = ["| | a (N_opt ∝ C^a) | b (D_opt ∝ C^b) | D/N at the largest budget |", "|---|---:|---:|---:|"]
    rows += [f"| {name} | {a} | {b} | {tpp} |" for name, a, b, tpp in fit_rows(fits)]
    lines = rows + ["", f"Largest budget {max(fits['budgets']):.3g} FLOPs; brackets: 90 % bootstrap intervals.", ""]
    if "approach3" in fits:
        a3 = fits["approach3"]
        lines.append(f"Approach 3 law: E {a3['E']:.3f}, A {a3['A']:.4g}, B {a3['B']:.4g}, α {a3['alpha']:.3f}, "
                     f"β {a3['beta']:.3f} (bootstrap SE of α {a3['se'].get('alpha', float('nan')):.3f}, "
                     f"β {a3['se'].get('beta', float('nan')):.3f}).")
    if "approach2_error" in fits:
        lines.append(f"Approach 2 not fitted: {fits['approach2_error']}")
    if "approach3_error" in fits:
        lines.append(f"Approach 3 not fitted: {fits['approach3_error']}")
    lines += ["", "| run | N (all params) | D (tokens) | D/N | steps | val loss | seconds |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        lines.append(f"| {r['id']} | {r['params']:,} | {r['tokens']:,} | {r['tokens'] / r['params']:.0f} | {r['steps']:,} | "
                     f"{r['val_loss']:.4f} | {r['seconds']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/sweep-cpu")
    ap.add_argument("--budgets", default=None, help="default: tformer sweep's (commands/sweep.py DEFAULT)")
    ap.add_argument("--bootstrap", type=int, default=200)
    args = ap.parse_args(argv)
    record = Run()
    settings = (["--budgets", args.budgets] if args.budgets else []) + ["--set", "threads=1"]
    rc = tformer(["sweep", "--out", args.out, "--bootstrap", str(args.bootstrap), *settings])
    if rc:
        return rc
    out = Path(args.out)
    fits = json.loads((out / "fits.json").read_text())
    runs = sorted(json.loads((out / "runs.json").read_text())["runs"].values(), key=lambda r: (r["budget"], r["params"]))
    shutil.copy(out / "isoflop.png", RESULTS / "scaling_isoflop.png")
    shutil.copy(out / "fits.png", RESULTS / "scaling_fits.png")
    text = "\n".join([
        "# IsoFLOP sweep on this machine", "",
        "1 torch thread per run (the seconds depend on how busy the machine was, which the record above gives "
        "for the last invocation only, as the sweep resumes; the losses do not). Corpus: the built-in stdlib source, character level. Context 64, batch "
        f"{DEFAULT['batch_size']}, AdamW, lr {DEFAULT['settings']['lr']:g} → {DEFAULT['settings']['min_lr']:g} cosine "
        f"per run, {DEFAULT['center_tokens_per_param']:g} tokens per parameter at each budget's middle size, "
        f"C = 6ND with N all parameters.", "",
        table(fits, runs), "",
        f"The same sweep from the command line: `tformer sweep --out {args.out} {' '.join(settings)}`.", ""])
    record.write(RESULTS / "scaling_sweep.md", text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
