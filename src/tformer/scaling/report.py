"""What a sweep found: both fits side by side with the published laws, as JSON and two PNG plots."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tformer.errors import ConfigError, InputError
from tformer.scaling.fit import fit_isoflop, fit_parametric
from tformer.scaling.laws import BESIROGLU, HOFFMANN, KAPLAN


def analyse(runs: list[dict], *, bootstrap: int = 100, seed: int = 0) -> dict:
    """Approach 2 and Approach 3 on a sweep's runs, with the papers' exponents beside ours.

    Approach 3 is skipped (with the reason in ``"approach3_error"``) when scipy is missing or the
    runs do not pin down five parameters.
    """
    flops = [r["budget"] for r in runs]
    n = [r["params"] for r in runs]
    d = [r["tokens"] for r in runs]
    loss = [r["val_loss"] for r in runs]
    top = max(flops)
    out: dict = {"n_runs": len(runs), "budgets": sorted(set(flops)),
                 "papers": {law.name: {"a": law.a, "b": law.b, "tokens_per_param_at_top_budget": law.tokens_per_parameter(top)}
                            for law in (HOFFMANN, BESIROGLU)}}
    out["papers"][KAPLAN.name] = {"a": KAPLAN.exponent, "b": 1 - KAPLAN.exponent}
    try:
        iso = fit_isoflop(flops, n, loss, bootstrap=bootstrap, seed=seed)
        out["approach2"] = {**iso.to_dict(), "tokens_per_param": [c / (6 * m) / m for c, m in zip(iso.budgets, iso.n_opt)]}
    except InputError as e:
        out["approach2_error"] = str(e)
    try:
        fit = fit_parametric(n, d, loss, screen=100, bootstrap=bootstrap, seed=seed, name="this sweep")
        out["approach3"] = {**fit.to_dict(),
                            "tokens_per_param": [fit.law.tokens_per_parameter(c) for c in sorted(set(flops))]}
    except (ConfigError, InputError) as e:
        out["approach3_error"] = str(e)
    return out


def fit_rows(analysis: dict) -> list[tuple[str, str, str, str]]:
    """The papers' laws and this sweep's fits, one row each: ``(name, a [90% interval], b, D/N at
    the largest budget)`` as text; the command's summary and the benchmark's table print these."""
    rows = []
    for name, p in analysis["papers"].items():
        tpp = p.get("tokens_per_param_at_top_budget")
        rows.append((name, f"{p['a']:.3f}", f"{p['b']:.3f}", f"{tpp:.1f}" if tpp else "-"))
    for key, label in (("approach2", "this sweep, Approach 2"), ("approach3", "this sweep, Approach 3")):
        if key in analysis:
            f = analysis[key]
            ci = f.get("a_ci") or f.get("ci", {}).get("a")
            a = f"{f['a']:.3f}" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")
            rows.append((label, a, f"{f['b']:.3f}", f"{f['tokens_per_param'][-1]:.1f}"))
    return rows


def plot(runs: list[dict], analysis: dict, folder: str | Path) -> list[Path]:
    """``isoflop.png`` (loss against N per budget, parabolas, optima) and ``fits.png`` (N_opt and
    D/N against C: Approach 2, Approach 3 and the papers). Needs matplotlib (the ``plot`` extra)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("plots need matplotlib; pip install 'tformer[plot]' (the JSON is written anyway).") from None
    folder = Path(folder)
    budgets = sorted({r["budget"] for r in runs})
    colours = plt.cm.viridis(np.linspace(0, 0.9, len(budgets)))
    iso, par = analysis.get("approach2"), analysis.get("approach3")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for c, col in zip(budgets, colours):
        rs = [r for r in runs if r["budget"] == c]
        ax.plot([r["params"] for r in rs], [r["val_loss"] for r in rs], "o", color=col, label=f"C = {c:.2g} FLOPs")
        x = np.geomspace(min(r["params"] for r in rs) / 1.3, max(r["params"] for r in rs) * 1.3, 100)
        if iso:
            c2, c1, c0 = iso["parabolas"][iso["budgets"].index(c)]
            ax.plot(x, c2 * np.log(x) ** 2 + c1 * np.log(x) + c0, "-", color=col, lw=1)
            n_opt = iso["n_opt"][iso["budgets"].index(c)]
            ax.plot([n_opt], [c2 * np.log(n_opt) ** 2 + c1 * np.log(n_opt) + c0], "*", color=col, ms=14, mec="k")
        if par:
            pred = par["E"] + par["A"] / x ** par["alpha"] + par["B"] / (c / (6 * x)) ** par["beta"]
            ax.plot(x, pred, ":", color=col, lw=1)
    ax.set(xscale="log", xlabel="parameters N (all, embeddings included)", ylabel="final validation loss (nats/token)",
           title="IsoFLOP curves: parabola fits (solid, ★ minimum), Approach 3 (dotted)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths = [folder / "isoflop.png"]
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    cs = np.geomspace(budgets[0] / 2, budgets[-1] * 2, 50)
    for law, style in ((HOFFMANN, "--"), (BESIROGLU, "-.")):
        a1.plot(cs, [law.optimal_n(c) for c in cs], style, color="grey", label=f"{law.name} (a={law.a:.2f})")
        a2.plot(cs, [law.tokens_per_parameter(c) for c in cs], style, color="grey", label=law.name)
    if iso:
        a1.plot(iso["budgets"], iso["n_opt"], "*", color="C3", ms=12, mec="k", label="parabola minima")
        a1.plot(cs, np.exp(iso["a"] * np.log(cs) + iso["log_k"]), "-", color="C3", label=f"Approach 2 (a={iso['a']:.2f})")
        a2.plot(iso["budgets"], iso["tokens_per_param"], "*", color="C3", ms=12, mec="k", label="Approach 2")
    if par:
        g = (par["alpha"] * par["A"] / (par["beta"] * par["B"])) ** (1 / (par["alpha"] + par["beta"]))
        n3 = g * (cs / 6) ** par["a"]
        a1.plot(cs, n3, "-", color="C0", label=f"Approach 3 (a={par['a']:.2f})")
        a2.plot(cs, cs / 6 / n3 / n3, "-", color="C0", label="Approach 3")
    a1.set(xscale="log", yscale="log", xlabel="compute C (FLOPs)", ylabel="compute-optimal N", title="N_opt against C")
    a2.set(xscale="log", yscale="log", xlabel="compute C (FLOPs)", ylabel="D_opt / N_opt (tokens per parameter)",
           title="tokens per parameter")
    a1.legend(fontsize=8)
    a2.legend(fontsize=8)
    for axis in (a1.xaxis, a2.xaxis):
        axis.set_minor_formatter(plt.NullFormatter())
    fig.tight_layout()
    paths.append(folder / "fits.png")
    fig.savefig(paths[1], dpi=120)
    plt.close(fig)
    return paths
