"""Claim 11: compute-optimal training uses about 20 tokens per parameter, so Kaplan-era models (GPT-3,
Gopher) were undertrained (Hoffmann et al. 2022, "Chinchilla").

(a) The closed forms behind ``tformer plan`` (:mod:`tformer.scaling.laws`): the parametric law
L(N, D) = E + A/N^α + B/D^β with Besiroglu et al.'s refit of Chinchilla's data, minimised under
C = 6ND, gives D_opt/N_opt at Chinchilla's budget; Kaplan et al.'s allocation at the same budget;
Gopher's (N, D) against Chinchilla's under the law.
(b) An IsoFLOP sweep on this machine (``tformer sweep``, :func:`tformer.scaling.sweep.run_sweep`, in its
own folder): for each budget, several sizes trained to exactly that budget with their own
cosine schedule; the parabola minimum in ln N per budget and N_opt ∝ C^a through them
(Hoffmann's Approach 2), with a bootstrap interval. With a cache the sweep's folder is kept until the
claim finishes, so a run stopped by a time limit resumes the sweep where it stopped.

This claim replaced the benchmark script scaling_sweep.py (since removed); its last results stay in
benchmarks/results/scaling/ as this claim's earlier record.
"""

from __future__ import annotations

from tformer.claims.base import Check, Claim
from tformer.claims.common import fmt, new_figure
from tformer.claims.resume import scratch_folder
from tformer.scaling.laws import BESIROGLU, HOFFMANN, KAPLAN
from tformer.errors import InputError
from tformer.scaling.fit import fit_isoflop
from tformer.scaling.sweep import SweepSpec, load_runs, run_sweep

CHINCHILLA = (70e9, 1.4e12)         # parameters, tokens (Hoffmann et al. Table 1)
GOPHER = (280e9, 300e9)
GPT3 = (175e9, 300e9)


def run(config: dict, progress) -> dict:
    spec = SweepSpec(**config["sweep"])
    with scratch_folder(progress, "sweep") as folder:    # kept while unfinished: a stopped sweep resumes there
        run_sweep(spec, folder, progress=False, log=lambda message: None)
        runs = load_runs(folder)
    try:
        iso = fit_isoflop([r["budget"] for r in runs], [r["params"] for r in runs], [r["val_loss"] for r in runs],
                          bootstrap=config["bootstrap"], seed=0)
        fit = {"budgets": iso.budgets, "n_opt": iso.n_opt, "a": iso.a, "a_ci": list(iso.a_ci) if iso.a_ci else None,
               "tokens_per_param": [b / (6 * n) / n for b, n in zip(iso.budgets, iso.n_opt)]}
    except InputError as e:                                  # e.g. a budget's curve opens downwards
        fit = {"error": str(e)}
    c = 6 * CHINCHILLA[0] * CHINCHILLA[1]
    laws = {law.name: {"n_opt": law.optimal_n(c), "tokens_per_param": law.tokens_per_parameter(c)}
            for law in (HOFFMANN, BESIROGLU, KAPLAN)}
    loss = {name: BESIROGLU.loss(*nd) for name, nd in (("chinchilla", CHINCHILLA), ("gopher", GOPHER), ("gpt3", GPT3))}
    return {"budget": c, "laws": laws, "law_loss": loss, "gopher_budget": 6 * GOPHER[0] * GOPHER[1],
            "gopher_n_opt": BESIROGLU.optimal_n(6 * GOPHER[0] * GOPHER[1]),
            "runs": [{k: r[k] for k in ("budget", "params", "tokens", "val_loss")} for r in runs],
            "fit": fit}


def checks(m: dict) -> list[Check]:
    ratio = m["laws"][BESIROGLU.name]["tokens_per_param"]
    kaplan = m["laws"][KAPLAN.name]["tokens_per_param"]
    under = GOPHER[0] / m["gopher_n_opt"]
    fit = m["fit"]
    a = fit.get("a", float("nan"))
    return [
        Check("the law (Besiroglu's refit of Chinchilla's data) puts 10-40 tokens per parameter at Chinchilla's "
              "budget", 10 <= ratio <= 40, f"{fmt(ratio)} tokens/parameter"),
        Check("earlier models undertrained: Kaplan's allocation gives < 1/5 of those tokens per parameter, and "
              "Gopher is >= 2x the law's optimal size at its budget",
              kaplan < ratio / 5 and under >= 2, f"Kaplan {fmt(kaplan)}/parameter; Gopher {fmt(under)}x N_opt"),
        Check("same compute, better model: the law's loss for Chinchilla (70B, 1.4T) is below Gopher's (280B, 300B)",
              m["law_loss"]["chinchilla"] < m["law_loss"]["gopher"],
              f"{fmt(m['law_loss']['chinchilla'], 4)} vs {fmt(m['law_loss']['gopher'], 4)} nats"),
        Check("this machine's IsoFLOP sweep: N_opt ∝ C^a with a in [0.3, 0.7] (Chinchilla ~0.5, not Kaplan's 0.73)",
              0.3 <= a <= 0.7, f"a = {fmt(a)}" + (f", 90% interval {fmt(fit['a_ci'][0])}-{fmt(fit['a_ci'][1])}"
                                                 if fit.get("a_ci") else "")),
    ]


def rows(m: dict) -> list[tuple[str, str, str]]:
    laws, fit = m["laws"], m["fit"]
    return [(f"tokens per parameter at Chinchilla's budget ({m['budget']:.2g} FLOPs)",
             "20 (70B on 1.4T tokens; Approach 1-2)",
             f"Besiroglu law {fmt(laws[BESIROGLU.name]['tokens_per_param'])}, Hoffmann's Approach 3 law "
             f"{fmt(laws[HOFFMANN.name]['tokens_per_param'])}, Kaplan {fmt(laws[KAPLAN.name]['tokens_per_param'])}"),
            ("Gopher's size over the optimal size at its budget", "4x (280B vs ~67B, Table 3)",
             fmt(GOPHER[0] / m["gopher_n_opt"])),
            ("law loss: Chinchilla / Gopher / GPT-3", "Chinchilla beats Gopher on nearly every task",
             " / ".join(fmt(m["law_loss"][k], 4) for k in ("chinchilla", "gopher", "gpt3"))),
            ("IsoFLOP exponent a (N_opt ∝ C^a), tiny models on this CPU", "0.49 (Approach 2); Kaplan 0.73",
             fmt(fit.get("a", float("nan"))) + (f" [{fmt(fit['a_ci'][0])}, {fmt(fit['a_ci'][1])}]"
                                                if fit.get("a_ci") else ""))]


def plot(m: dict):
    fig, (a, b) = new_figure(2, width=4.8)
    budgets = sorted({r["budget"] for r in m["runs"]})
    for i, c in enumerate(budgets):
        rs = [r for r in m["runs"] if r["budget"] == c]
        a.plot([r["params"] for r in rs], [r["val_loss"] for r in rs], "o-", color=f"C{i}", label=f"C = {c:.2g}")
    for c, n in zip(m["fit"].get("budgets", []), m["fit"].get("n_opt", [])):
        a.axvline(n, color=f"C{budgets.index(c)}", ls=":", lw=1)
    a.set(xscale="log", xlabel="parameters N", ylabel="validation loss", title="IsoFLOP curves (this machine)")
    a.legend(fontsize=7)
    import numpy as np

    cs = np.logspace(20, 25, 30)
    for law, style in ((BESIROGLU, "-"), (HOFFMANN, "--"), (KAPLAN, ":")):
        b.plot(cs, [law.tokens_per_parameter(c) for c in cs], style, label=law.name)
    b.axhline(20, color="grey", lw=0.8)
    b.plot([m["budget"]], [CHINCHILLA[1] / CHINCHILLA[0]], "k*", ms=10, label="Chinchilla (20)")
    b.plot([m["gopher_budget"]], [GOPHER[1] / GOPHER[0]], "kx", ms=8, label="Gopher (1.1)")
    b.set(xscale="log", yscale="log", xlabel="training FLOPs C", ylabel="tokens per parameter D_opt/N_opt",
          title="compute-optimal tokens per parameter")
    b.legend(fontsize=7)
    fig.tight_layout()
    return fig


CLAIM = Claim(
    name="chinchilla-tokens", order=11, title="Chinchilla: ~20 tokens per parameter; earlier models undertrained",
    sentence="For a fixed compute budget, parameters and training tokens should grow in equal proportion, about "
             "20 tokens per parameter; Kaplan et al.'s allocation, followed by GPT-3 and Gopher, gave too many "
             "parameters too few tokens.",
    source="Hoffmann et al. 2022, Training Compute-Optimal Large Language Models, Table 2-3, Fig. 3 (IsoFLOP); "
           "Besiroglu et al. 2024 (refit of Approach 3); Kaplan et al. 2020, Table 6",
    published=[("Chinchilla", "70B parameters on 1.4T tokens (20 per parameter) beats Gopher 280B on 300B"),
               ("Table 2, N_opt ∝ C^a", "a = 0.50 (Approach 1), 0.49 (2), 0.46 (3); Kaplan 0.73")],
    sizes={"quick": {"bootstrap": 10, "sweep": {"budgets": [1.5e8, 3e8], "sizes": 3, "spread": 6.0,
                                                "context_length": 16, "batch_size": 4, "min_steps": 10,
                                                "ladder": [[1, 16, 1], [1, 24, 1], [1, 32, 2], [2, 32, 2], [2, 48, 3]],
                                                "settings": {"eval_batches": 4, "warmup_steps": 2}}},
           "full": {"bootstrap": 100, "sweep": {"budgets": [1e10, 3e10, 1e11], "center_tokens_per_param": 100.0,
                                                "batch_size": 8, "settings": {"lr": 3e-3, "min_lr": 3e-4}}}},
    run=run, checks=checks, rows=rows, plot=plot,
    notes="(a) is arithmetic on published fits, not a measurement. (b) trains tiny character-level models "
          "(2.7k-70k parameters) on the stdlib corpus at 1e10-1e11 FLOPs, 12 orders of magnitude below Chinchilla; "
          "such models need more tokens per parameter than 20 (the earlier record found ~100), so only the "
          "exponent is compared. The quick size's budgets are too small for a meaningful fit.",
)
