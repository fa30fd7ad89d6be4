"""Published scaling laws: how a training budget should be split between parameters and tokens.

Training a dense transformer costs about ``C = 6 N D`` FLOPs (N parameters, D tokens: 2 FLOPs per
multiply-add forward, twice that backward). Hoffmann et al. (2022, "Chinchilla") model the final
loss as

    L(N, D) = E + A / N^α + B / D^β

(E: the entropy of text, which no model removes; A/N^α: the cost of a finite model; B/D^β: of
finite data). Minimising L on the line ``C = 6 N D`` (set dL/dN = 0 with D = C / 6N) gives

    N_opt(C) = G (C/6)^a,   D_opt(C) = G⁻¹ (C/6)^b,   a = β/(α+β),  b = α/(α+β),
    G = (α A / (β B))^(1/(α+β)),

so with α ≈ β both grow as √C and the ratio D/N is nearly constant (about 20 tokens per parameter).
Kaplan et al. (2020) fitted instead ``N_opt ∝ C^0.73`` (their Table 6, non-embedding N):
most of a larger budget goes to the model.

Pure Python (no numpy, no scipy): the planner must run with the core install.
"""

from __future__ import annotations

from dataclasses import dataclass

PF_DAY = 1e15 * 86400          # FLOPs in one petaFLOP/s-day, Kaplan et al.'s unit of compute


@dataclass(frozen=True)
class ChinchillaLaw:
    """``L(N, D) = E + A/N^alpha + B/D^beta`` (loss in nats per token) and its compute-optimal split."""

    name: str
    E: float
    A: float
    B: float
    alpha: float
    beta: float
    source: str = ""

    def loss(self, n_params: float, n_tokens: float) -> float:
        """Predicted final loss of an N-parameter model trained on D tokens."""
        return self.E + self.A / n_params ** self.alpha + self.B / n_tokens ** self.beta

    @property
    def a(self) -> float:
        """Exponent of ``N_opt ∝ C^a``."""
        return self.beta / (self.alpha + self.beta)

    @property
    def b(self) -> float:
        """Exponent of ``D_opt ∝ C^b`` (a + b = 1)."""
        return self.alpha / (self.alpha + self.beta)

    @property
    def G(self) -> float:
        return (self.alpha * self.A / (self.beta * self.B)) ** (1 / (self.alpha + self.beta))

    def optimal_n(self, flops: float) -> float:
        """Compute-optimal parameters for ``flops`` training FLOPs: ``G (C/6)^a``."""
        return self.G * (flops / 6) ** self.a

    def optimal_d(self, flops: float) -> float:
        """Compute-optimal tokens: ``(C/6) / N_opt``."""
        return flops / 6 / self.optimal_n(flops)

    def flops_for_n(self, n_params: float) -> float:
        """The budget whose optimal model has ``n_params`` parameters (inverse of :meth:`optimal_n`)."""
        return 6 * (n_params / self.G) ** (1 / self.a)

    def flops_for_d(self, n_tokens: float) -> float:
        """The budget whose optimal run sees ``n_tokens`` tokens: D = G⁻¹ (C/6)^b inverted."""
        return 6 * (n_tokens * self.G) ** (1 / self.b)

    def tokens_per_parameter(self, flops: float) -> float:
        """``D_opt / N_opt`` at ``flops`` (it drifts as ``C^(b-a)``, slowly when α ≈ β)."""
        return self.optimal_d(flops) / self.optimal_n(flops)


@dataclass(frozen=True)
class KaplanAllocation:
    """Kaplan et al. (2020), Table 6: ``N_opt = 1.3e9 · (C / PF-day)^0.73`` (non-embedding N).

    Their loss law L(N, D) was fitted to WebText2 with GPT-2's tokenizer and is not comparable to
    Chinchilla's, so only the allocation is used. D follows from ``C = 6 N D``, which keeps the
    budget exact; their own Table 6 row ``D_opt = 2e10 · C^0.27`` is about 1.8x larger because
    their C_min is the compute at a batch far below the critical one.
    """

    name: str = "Kaplan 2020"
    n_at_pf_day: float = 1.3e9
    exponent: float = 0.73
    source: str = "Kaplan et al. 2020, Scaling Laws for Neural Language Models, Table 6"

    def optimal_n(self, flops: float) -> float:
        return self.n_at_pf_day * (flops / PF_DAY) ** self.exponent

    def optimal_d(self, flops: float) -> float:
        return flops / 6 / self.optimal_n(flops)

    def flops_for_n(self, n_params: float) -> float:
        return PF_DAY * (n_params / self.n_at_pf_day) ** (1 / self.exponent)

    def flops_for_d(self, n_tokens: float) -> float:
        # D = C / (6 k (C/P)^e)  =>  C^(1-e) = 6 k D P^(-e)
        return (6 * self.n_at_pf_day * n_tokens * PF_DAY ** (-self.exponent)) ** (1 / (1 - self.exponent))

    def tokens_per_parameter(self, flops: float) -> float:
        return self.optimal_d(flops) / self.optimal_n(flops)


# Hoffmann et al. 2022, section 3.3 (Approach 3), as printed in the paper's body.
HOFFMANN = ChinchillaLaw("Hoffmann 2022", E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28,
                         source="Hoffmann et al. 2022, Training Compute-Optimal Large Language Models, section 3.3")
# Besiroglu et al. 2024, Table 1: the same Approach 3 refitted to the points read off Figure 4.
BESIROGLU = ChinchillaLaw("Besiroglu 2024", E=1.8172, A=482.01, B=2085.43, alpha=0.3478, beta=0.3658,
                          source="Besiroglu et al. 2024, Chinchilla Scaling: A replication attempt, Table 1")
# Their bootstrap standard errors (Table 1, in parentheses), the uncertainty the refit test uses.
BESIROGLU_SE = {"E": 0.03, "A": 124.58, "B": 1293.23, "alpha": 0.02, "beta": 0.02, "a": 0.02}
KAPLAN = KaplanAllocation()
LAWS = (HOFFMANN, BESIROGLU, KAPLAN)
