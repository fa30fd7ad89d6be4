"""Fitting scaling laws to training runs: Hoffmann et al.'s Approach 3 (parametric) and Approach 2 (IsoFLOP parabolas).

**Approach 3.** Fit ``L(N, D) = E + A/N^α + B/D^β`` to runs ``(N_i, D_i, L_i)``. Written in logs,
with ``A = e^a``, ``B = e^b``, ``E = e^e``, the prediction is a LogSumExp:

    log L̂_i = LSE(a - α log N_i,  b - β log D_i,  e)

which is smooth and keeps A, B, E positive without constraints. The objective is
``Σ_i Huber_δ(log L̂_i - log L_i)`` with δ = 10⁻³: quadratic for residuals under 0.1 % of the
loss, linear beyond, so a few bad runs (or points misread off a plot) do not drag the fit.
It has several local minima, so L-BFGS starts from every point of a grid (Hoffmann et al.: α, β
in {0, 0.5, ..., 2}, e in {-1, -0.5, ..., 1}, a, b in {0, 5, ..., 25}) and the best end wins.
The sum (not the mean) is minimised with tight tolerances: Besiroglu et al. (2024) traced
Hoffmann's published values to L-BFGS stopping early on the 400-times smaller mean.
Confidence intervals come from the bootstrap: refit on runs resampled with replacement.

**Approach 2.** For each budget C, fit a parabola to loss against log N over the runs of that
budget; its vertex is N_opt(C). A line through (log C, log N_opt) gives ``N_opt ∝ C^a``;
with ``D = C / 6N``, ``D_opt ∝ C^(1-a)``.

Approach 3 needs ``scipy`` (the ``scaling`` extra); Approach 2 needs only numpy.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field

import numpy as np

from tformer.errors import ConfigError, InputError
from tformer.scaling.laws import ChinchillaLaw

DELTA = 1e-3
# Hoffmann et al.'s grid of starts (Appendix D.2): 5 x 5 x 5 x 6 x 6 = 4500 points, in (e, a, b, alpha, beta).
HOFFMANN_GRID = dict(e=np.arange(-1, 1.01, 0.5), a=np.arange(0, 25.1, 5), b=np.arange(0, 25.1, 5),
                     alpha=np.arange(0, 2.01, 0.5), beta=np.arange(0, 2.01, 0.5))


def _scipy_minimize():
    try:
        from scipy.optimize import minimize
    except ImportError:
        raise ConfigError("the Approach-3 fit needs scipy; install it with pip install 'tformer[scaling]' "
                          "(the planner works without it).") from None
    return minimize


def huber(r: np.ndarray, delta: float = DELTA) -> tuple[np.ndarray, np.ndarray]:
    """Huber loss of residuals ``r`` and its derivative: ``r²/2`` inside ``|r| <= δ``, ``δ(|r| - δ/2)`` outside."""
    inside = np.abs(r) <= delta
    value = np.where(inside, 0.5 * r * r, delta * (np.abs(r) - 0.5 * delta))
    grad = np.where(inside, r, delta * np.sign(r))
    return value, grad


def _objective(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray,
               delta: float) -> tuple[float, np.ndarray]:
    """Σ Huber(LSE(a - α log N, b - β log D, e) - log L) and its gradient in θ = (e, a, b, α, β)."""
    e, a, b, alpha, beta = theta
    terms = np.stack([a - alpha * log_n, b - beta * log_d, np.full_like(log_n, e)])   # (3, n)
    top = terms.max(axis=0)                                                            # (n,)
    w = np.exp(terms - top)                                                            # (3, n)
    total = w.sum(axis=0)
    pred = top + np.log(total)                                                         # (n,) log L̂
    w /= total                                                                         # softmax = d pred / d term
    value, g = huber(pred - log_l, delta)                                              # (n,), (n,)
    grad = np.array([g @ w[2], g @ w[0], g @ w[1], -(g * w[0]) @ log_n, -(g * w[1]) @ log_d])
    return float(value.sum()), grad


@dataclass
class ParametricFit:
    """An Approach-3 fit: the law, the objective at its minimum, and (optionally) bootstrap spreads."""

    law: ChinchillaLaw
    objective: float
    n_points: int
    n_starts: int
    se: dict[str, float] = field(default_factory=dict)          # bootstrap standard errors
    ci: dict[str, tuple[float, float]] = field(default_factory=dict)  # bootstrap percentile intervals

    def to_dict(self) -> dict:
        return {**asdict(self.law), "a": self.law.a, "b": self.law.b, "objective": self.objective,
                "n_points": self.n_points, "n_starts": self.n_starts, "se": self.se,
                "ci": {k: list(v) for k, v in self.ci.items()}}


def _law(theta: np.ndarray, name: str) -> ChinchillaLaw:
    e, a, b, alpha, beta = (float(t) for t in theta)
    return ChinchillaLaw(name, E=float(np.exp(e)), A=float(np.exp(a)), B=float(np.exp(b)), alpha=alpha, beta=beta,
                         source="Approach 3 fit (Huber δ=1e-3 on log loss, L-BFGS from a grid)")


def _check_runs(n, d, loss) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n, d, loss = (np.asarray(x, dtype=float).ravel() for x in (n, d, loss))
    if not (len(n) == len(d) == len(loss)):
        raise InputError(f"N, D and loss need one value per run, got {len(n)}, {len(d)} and {len(loss)}.")
    if len(n) < 5:
        raise InputError(f"a five-parameter law needs at least 5 runs, got {len(n)}; train more runs.")
    if not (np.all(n > 0) and np.all(d > 0) and np.all(loss > 0) and np.all(np.isfinite(loss))):
        raise InputError("every run needs positive parameters, tokens and a finite positive loss; drop the bad runs.")
    return np.log(n), np.log(d), np.log(loss)


def _minimise(starts: np.ndarray, logs, delta: float) -> tuple[np.ndarray, float]:
    minimize = _scipy_minimize()
    best_x, best_f = None, np.inf
    for x0 in starts:
        r = minimize(_objective, x0, args=(*logs, delta), jac=True, method="L-BFGS-B",
                     options=dict(maxiter=2000, ftol=1e-15, gtol=1e-12))
        if np.isfinite(r.fun) and r.fun < best_f:
            best_x, best_f = r.x, float(r.fun)
    if best_x is None:
        raise InputError("the fit found no finite optimum from any start; check the runs for extreme values.")
    return best_x, best_f


def _best_starts(starts: np.ndarray, logs, delta: float, k: int) -> np.ndarray:
    """The ``k`` starts with the lowest objective."""
    log_n, log_d, log_l = logs
    e, a, b, alpha, beta = (starts[:, i:i + 1] for i in range(5))                     # (S, 1) each
    terms = np.stack(np.broadcast_arrays(a - alpha * log_n, b - beta * log_d, e + 0 * log_n))  # (3, S, n)
    pred = np.logaddexp(np.logaddexp(terms[0], terms[1]), terms[2])                    # (S, n)
    values = huber(pred - log_l, delta)[0].sum(axis=1)                                 # (S,)
    return starts[np.argsort(values, kind="stable")[:k]]


def grid_starts(grid: dict | None = None) -> np.ndarray:
    """All combinations of the grid, as rows (e, a, b, alpha, beta)."""
    g = grid or HOFFMANN_GRID
    return np.array(list(itertools.product(g["e"], g["a"], g["b"], g["alpha"], g["beta"])), dtype=float)


def fit_parametric(n, d, loss, *, delta: float = DELTA, grid: dict | None = None, screen: int | None = None,
                   bootstrap: int = 0, seed: int = 0, name: str = "fit") -> ParametricFit:
    """Approach 3: the law minimising Σ Huber_δ(log L̂ - log L) over runs (N, D, loss).

    Args:
        grid: starting values per parameter (keys e, a, b, alpha, beta); default Hoffmann's grid.
        screen: run L-BFGS only from this many grid points, those with the lowest objective
            (``None``: from all of them, as Hoffmann et al. did).
        bootstrap: resample the runs this many times and refit (each from the full-data optimum
            and the 5 best grid starts) for standard errors and 90 % percentile intervals.
    """
    logs = _check_runs(n, d, loss)
    starts = grid_starts(grid)
    if screen is not None:
        starts = _best_starts(starts, logs, delta, screen)
    theta, best = _minimise(starts, logs, delta)
    fit = ParametricFit(_law(theta, name), best, len(logs[0]), len(starts))
    if bootstrap:
        fit.se, fit.ci = _bootstrap(theta, starts, logs, delta, bootstrap, seed)
    return fit


def _bootstrap(theta, starts, logs, delta, k, seed):
    rng = np.random.default_rng(seed)
    n = len(logs[0])
    keys = ("E", "A", "B", "alpha", "beta", "a", "b")
    draws = {key: [] for key in keys}
    for _ in range(k):
        idx = rng.integers(0, n, n)
        sample = tuple(x[idx] for x in logs)
        t, _ = _minimise(np.vstack([theta, _best_starts(starts, sample, delta, 5)]), sample, delta)
        law = _law(t, "bootstrap")
        for key in keys:
            draws[key].append(getattr(law, key))
    se = {key: float(np.std(v, ddof=1)) for key, v in draws.items()}
    ci = {key: (float(np.percentile(v, 5)), float(np.percentile(v, 95))) for key, v in draws.items()}
    return se, ci


# ---------------------------------------------------------------------------------------- Approach 2
@dataclass
class IsoFlopFit:
    """Approach 2: per-budget parabola minima and the power laws through them."""

    budgets: list[float]
    n_opt: list[float]              # parabola vertex per budget
    parabolas: list[list[float]]    # (c2, c1, c0) of loss = c2 x² + c1 x + c0, x = ln N
    a: float                        # N_opt ∝ C^a
    b: float                        # D_opt ∝ C^b (= 1 - a under C = 6ND)
    log_k: float                    # ln N_opt = a ln C + log_k
    bracketed: list[bool] = field(default_factory=list)   # vertex inside the budget's range of sizes
    a_ci: tuple[float, float] | None = None

    def optimal_n(self, flops: float) -> float:
        return float(np.exp(self.a * np.log(flops) + self.log_k))

    def tokens_per_parameter(self, flops: float) -> float:
        n = self.optimal_n(flops)
        return flops / (6 * n) / n

    def to_dict(self) -> dict:
        return asdict(self)


def parabola_minimum(n, loss) -> tuple[float, list[float]]:
    """Vertex N of the parabola ``loss = c2 (ln N)² + c1 ln N + c0`` fitted by least squares.

    Raises:
        InputError: fewer than three model sizes, or a curve that opens downwards (no minimum).
    """
    x, y = np.log(np.asarray(n, dtype=float)), np.asarray(loss, dtype=float)
    if len(np.unique(x)) < 3:
        raise InputError(f"an IsoFLOP parabola needs at least 3 model sizes per budget, got {len(np.unique(x))}.")
    c2, c1, c0 = np.polyfit(x, y, 2)
    if c2 <= 0:
        raise InputError("the losses of one budget do not curve upwards around a minimum; widen the range of "
                         "model sizes for that budget (smaller and larger models).")
    return float(np.exp(-c1 / (2 * c2))), [float(c2), float(c1), float(c0)]


def fit_isoflop(flops, n, loss, *, bootstrap: int = 0, seed: int = 0) -> IsoFlopFit:
    """Approach 2 on runs (budget C, parameters N, final loss), grouped by budget.

    ``bootstrap`` resamples the runs within each budget and refits, for a 90 % interval on a.
    """
    flops, n, loss = (np.asarray(v, dtype=float) for v in (flops, n, loss))
    budgets = sorted(set(flops.tolist()))
    if len(budgets) < 2:
        raise InputError(f"Approach 2 needs at least 2 compute budgets, got {len(budgets)}.")
    groups = [np.flatnonzero(flops == c) for c in budgets]
    fits = [parabola_minimum(n[g], loss[g]) for g in groups]
    n_opt = [f[0] for f in fits]
    a, log_k = np.polyfit(np.log(budgets), np.log(n_opt), 1)
    bracketed = [bool(n[g].min() <= m <= n[g].max()) for g, m in zip(groups, n_opt)]
    out = IsoFlopFit(budgets, n_opt, [f[1] for f in fits], float(a), float(1 - a), float(log_k), bracketed)
    if bootstrap:
        rng, slopes = np.random.default_rng(seed), []
        for _ in range(bootstrap):
            try:
                opt = [parabola_minimum(n[s], loss[s])[0] for s in (rng.choice(g, len(g)) for g in groups)]
            except InputError:
                continue                                 # a resample with < 3 sizes or no minimum
            slopes.append(np.polyfit(np.log(budgets), np.log(opt), 1)[0])
        if slopes:
            out.a_ci = (float(np.percentile(slopes, 5)), float(np.percentile(slopes, 95)))
    return out
