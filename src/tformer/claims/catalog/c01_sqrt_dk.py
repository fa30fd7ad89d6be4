"""Claim 1: scaling the logits by 1/√d_k keeps the softmax out of saturation (Vaswani et al., 2017).

For q, k with independent unit-variance components, q·k = Σ q_i k_i has variance d_k. Unscaled, the
logits' spread grows like √d_k, the softmax collapses onto its largest logit, its entropy goes to 0 and
its Jacobian diag(p) - p pᵀ (the gradient that reaches the logits) vanishes. Scaled by 1/√d_k, the
logits have unit variance at every d_k. We measure all three through tformer's attention function.
"""

from __future__ import annotations

import math

import torch

from tformer.ops.sdpa import scaled_dot_product_attention
from tformer.claims.base import Check, Claim
from tformer.claims.common import fmt, new_figure


def measure(d_k: int, n_queries: int, n_keys: int, scaled: bool, seed: int) -> dict:
    """Dot-product variance, softmax entropy and the logits' gradient norm at one d_k."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n_queries, d_k, generator=g, dtype=torch.float64)          # (n, d_k)
    k = torch.randn(n_keys, d_k, generator=g, dtype=torch.float64)             # (m, d_k)
    v = torch.randn(n_keys, 16, generator=g, dtype=torch.float64)              # (m, 16)
    upstream = torch.randn(n_queries, 16, generator=g, dtype=torch.float64)    # dLoss/dout
    bias = torch.zeros(n_queries, n_keys, dtype=torch.float64, requires_grad=True)  # its grad = dLoss/dlogits
    out, w = scaled_dot_product_attention(q, k, v, bias=bias, scale=None if scaled else 1.0,
                                          backend="math", return_weights=True)  # (n, 16), (n, m)
    (out * upstream).sum().backward()
    w = w.detach()
    entropy = -(w * w.clamp_min(1e-300).log()).sum(-1)                        # (n,)
    grad = bias.grad.norm(dim=-1)                                              # (n,) one per query row
    return {"d_k": d_k, "dot_var": float((q @ k.T).var()), "entropy": float(entropy.mean()),
            "grad_norm": float(grad.median()), "grad_norm_mean": float(grad.mean())}


def run(config: dict, progress) -> dict:
    rows = []
    for d_k in progress(config["dims"], "d_k"):
        for scaled in (True, False):
            r = measure(d_k, config["queries"], config["keys"], scaled, seed=d_k)
            rows.append({**r, "scaled": scaled})
    return {"rows": rows, "keys": config["keys"]}


def _series(m: dict, scaled: bool, key: str) -> list[float]:
    return [r[key] for r in m["rows"] if r["scaled"] == scaled]


def checks(m: dict) -> list[Check]:
    dims = _series(m, True, "d_k")
    ratios = [v / d for v, d in zip(_series(m, True, "dot_var"), dims)]
    hs, hu = _series(m, True, "entropy"), _series(m, False, "entropy")
    gs, gu = _series(m, True, "grad_norm"), _series(m, False, "grad_norm")
    return [
        Check("Var(q·k)/d_k within [0.9, 1.1] at every d_k", all(0.9 <= r <= 1.1 for r in ratios),
              f"ratios {', '.join(fmt(r) for r in ratios)}"),
        Check("scaled: softmax entropy at the largest d_k >= 0.9 x its value at the smallest", hs[-1] >= 0.9 * hs[0],
              f"{fmt(hs[0])} -> {fmt(hs[-1])} nats"),
        Check("unscaled: entropy at the largest d_k <= 0.25 x the scaled one", hu[-1] <= 0.25 * hs[-1],
              f"{fmt(hu[-1])} vs {fmt(hs[-1])} nats"),
        Check("unscaled: median gradient norm at the logits at the largest d_k <= 0.1 x the scaled one",
              gu[-1] <= 0.1 * gs[-1], f"{fmt(gu[-1])} vs {fmt(gs[-1])}"),
    ]


def rows(m: dict) -> list[tuple[str, str, str]]:
    dims = _series(m, True, "d_k")
    hs, hu = _series(m, True, "entropy"), _series(m, False, "entropy")
    gs, gu = _series(m, True, "grad_norm"), _series(m, False, "grad_norm")
    mean_ratio = _series(m, False, "grad_norm_mean")[-1] / _series(m, True, "grad_norm_mean")[-1]
    var = _series(m, True, "dot_var")
    return [
        (f"Var(q·k) at d_k = {dims[-1]}", f"d_k = {dims[-1]}", fmt(var[-1], 4)),
        (f"softmax entropy over {m['keys']} keys, scaled (d_k {dims[0]} → {dims[-1]})", "stays (no figure)",
         f"{fmt(hs[0])} → {fmt(hs[-1])} nats (max ln {m['keys']} = {math.log(m['keys']):.3g})"),
        (f"softmax entropy, unscaled (d_k {dims[0]} → {dims[-1]})", "collapses (no figure)",
         f"{fmt(hu[0])} → {fmt(hu[-1])} nats"),
        (f"gradient norm at the logits, d_k = {dims[-1]}: unscaled / scaled, median (mean) over queries",
         "'extremely small'", f"{fmt(gu[-1] / gs[-1])} ({fmt(mean_ratio)})"),
    ]


def plot(m: dict):
    fig, (a, b, c) = new_figure(3, width=4.2)
    dims = _series(m, True, "d_k")
    a.plot(dims, [v / d for v, d in zip(_series(m, True, "dot_var"), dims)], "o-")
    a.axhline(1.0, color="gray", ls="--", label="published: Var = d_k")
    a.set(xscale="log", ylim=(0.5, 1.5), xlabel="d_k", ylabel="Var(q·k) / d_k", title="dot-product variance")
    a.legend(fontsize=8)
    for scaled, label in ((True, "scaled 1/√d_k"), (False, "unscaled")):
        b.plot(dims, _series(m, scaled, "entropy"), "o-", label=label)
        c.plot(dims, _series(m, scaled, "grad_norm"), "o-", label=label)
    b.axhline(math.log(m["keys"]), color="gray", ls="--", label=f"uniform (ln {m['keys']})")
    b.set(xscale="log", xlabel="d_k", ylabel="entropy (nats)", title="softmax entropy")
    c.set(xscale="log", yscale="log", xlabel="d_k", ylabel="median ‖∂loss/∂logits‖",
          title="gradient at the logits")
    b.legend(fontsize=8), c.legend(fontsize=8)
    fig.tight_layout()
    return fig


CLAIM = Claim(
    name="sqrt-dk", order=1, title="Scaled dot products keep the softmax alive",
    sentence="Dot products of unit-variance vectors have variance d_k; scaling the logits by 1/√d_k keeps the "
             "softmax's entropy and gradients from collapsing as d_k grows.",
    source="Vaswani et al. 2017, Attention Is All You Need, §3.2.1 and its footnote 4",
    published=[("Var(q·k) for independent unit-variance components", "d_k (derived in footnote 4)"),
               ("effect without scaling", "softmax pushed into regions of extremely small gradients (no figure)")],
    sizes={"quick": {"dims": [16, 64, 256, 1024], "queries": 256, "keys": 64},
           "full": {"dims": [4, 16, 64, 256, 1024, 4096], "queries": 4096, "keys": 128}},
    run=run, checks=checks, rows=rows, plot=plot,
    notes="Gaussian q, k, v in float64; the gradient is that of ⟨out, g⟩ for a random g, read at a zero bias "
          "added to the logits (so it is exactly ∂loss/∂logits); its norm per query row, median over rows (a few "
          "rows with a near-tie keep large gradients, so the mean is also shown).",
)
