"""Claim 15: next-token prediction on unlabelled text keeps improving as a power law in the tokens seen
(Radford et al. 2018/2019; Kaplan et al. 2020, L(D) = (D_c / D)^α_D).

One small byte-level decoder trained on fresh windows of raw text (this Python's standard-library
source: no labels, nothing but the next byte) with the library's loop. Each step's batch is new text
drawn at random, so the training loss at step s estimates the loss on unseen text after D = s·B·T
tokens. The losses after warm-up are averaged in geometric bins of D and fitted by least squares
in log-log, log L = log k − α log D; the interval on α is the 5-95% range of a bootstrap over the
bins. The final model's validation loss (held-out tail of the corpus) is compared with the
unigram entropy of the bytes, the best a model without context can do.
"""

from __future__ import annotations

import math

import numpy as np

from tformer.claims.base import Check, Claim
from tformer.claims.common import byte_corpus, eval_loss, fmt, new_figure, train_lm
from tformer.config import TransformerConfig


def power_fit(d: np.ndarray, loss: np.ndarray, n_boot: int, seed: int = 0) -> dict:
    """Least squares log L = c − α log D; α, c, R² and a bootstrap (over points) 90% interval of α."""
    x, y = np.log(d), np.log(loss)
    slope, c = np.polyfit(x, y, 1)
    r2 = 1 - ((y - (slope * x + c)) ** 2).sum() / ((y - y.mean()) ** 2).sum()
    rng = np.random.default_rng(seed)
    boots = []
    for _ in range(n_boot):
        i = rng.integers(0, len(x), len(x))
        if np.ptp(x[i]) > 0:
            boots.append(-np.polyfit(x[i], y[i], 1)[0])
    lo, hi = np.percentile(boots, [5, 95]) if boots else (math.nan, math.nan)
    return {"alpha": float(-slope), "log_k": float(c), "r2": float(r2), "alpha_ci": [float(lo), float(hi)]}


def unigram_entropy(data: np.ndarray) -> float:
    counts = np.bincount(data, minlength=256).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def run(config: dict, progress) -> dict:
    c = config
    train, val = byte_corpus(c["corpus_bytes"])
    cfg = TransformerConfig(vocab_size=256, n_layers=c["layers"], d_model=c["d_model"], n_heads=c["heads"],
                            context_length=c["block"], positions="rope")
    model, losses = train_lm(cfg, train, steps=c["steps"], batch_size=c["batch"], block=c["block"], lr=c["lr"],
                             warmup=c["warmup"], seed=0, progress=progress, desc="train")
    per_step = c["batch"] * c["block"]
    edges = np.unique(np.geomspace(c["warmup"] + 1, c["steps"], c["bins"] + 1).astype(int))
    d, l = [], []
    for lo, hi in zip(edges[:-1], edges[1:]):
        chunk = [x for x in losses[lo - 1:hi] if x == x]
        if chunk:
            d.append(per_step * (lo + hi) / 2)
            l.append(float(np.mean(chunk)))
    return {"tokens": d, "loss": l, "fit": power_fit(np.array(d), np.array(l), c["bootstrap"]),
            "val_loss": eval_loss(model, val, c["block"], c["eval_tokens"]), "unigram": unigram_entropy(train),
            "params": model.num_parameters(), "total_tokens": per_step * c["steps"]}


def checks(m: dict) -> list[Check]:
    f = m["fit"]
    return [
        Check("loss falls as a power law in tokens: α > 0 with its 90% interval above 0, and R² >= 0.9",
              f["alpha_ci"][0] > 0 and f["r2"] >= 0.9,
              f"α = {fmt(f['alpha'])} [{fmt(f['alpha_ci'][0])}, {fmt(f['alpha_ci'][1])}], R² {fmt(f['r2'])}"),
        Check("without labels it learns more than byte frequencies: held-out loss < the unigram entropy - 0.5 nats",
              m["val_loss"] < m["unigram"] - 0.5, f"val {fmt(m['val_loss'], 4)} vs unigram {fmt(m['unigram'], 4)}"),
    ]


def rows(m: dict) -> list[tuple[str, str, str]]:
    f = m["fit"]
    return [("α_D in L ∝ D^(−α_D)", "0.095 (Kaplan et al. 2020, eq. 1.2, data-limited, large models)",
             f"{fmt(f['alpha'])} [90%: {fmt(f['alpha_ci'][0])}, {fmt(f['alpha_ci'][1])}], R² {fmt(f['r2'])} "
             f"({m['params']:,} parameters, {m['total_tokens']:,} tokens)"),
            ("held-out loss vs unigram entropy (nats/byte)", "unsupervised pre-training learns structure "
             "(GPT-1/2)", f"{fmt(m['val_loss'], 4)} vs {fmt(m['unigram'], 4)}")]


def plot(m: dict):
    fig, (a,) = new_figure(1, width=5.6)
    d, l, f = np.array(m["tokens"]), np.array(m["loss"]), m["fit"]
    a.plot(d, l, "o", label="training loss on fresh text (binned)")
    a.plot(d, np.exp(f["log_k"]) * d ** (-f["alpha"]), "-", label=f"fit: α = {fmt(f['alpha'])}")
    a.axhline(m["unigram"], color="grey", ls=":", label="unigram entropy")
    a.set(xscale="log", yscale="log", xlabel="tokens seen D", ylabel="loss (nats/byte)",
          title="decoder-only, unlabelled text: loss vs tokens")
    a.legend(fontsize=8)
    return fig


CLAIM = Claim(
    name="decoder-scaling", order=15, title="Next-token prediction on unlabelled text scales as a power law",
    sentence="A decoder trained only to predict the next token of raw, unlabelled text keeps improving as it "
             "sees more text, its loss falling as a power law in the number of tokens.",
    source="Kaplan et al. 2020, Scaling Laws for Neural Language Models, eq. (1.2) and Fig. 1; Radford et al. "
           "2019, GPT-2 (unsupervised next-token prediction)",
    published=[("Kaplan eq. (1.2)", "L(D) = (D_c / D)^α_D, α_D ≈ 0.095, D_c ≈ 5.4e13 tokens"),
               ("Fig. 1", "test loss a straight line in log-log over tokens, for large enough models")],
    sizes={"quick": {"corpus_bytes": 300_000, "layers": 2, "d_model": 48, "heads": 4, "block": 32, "batch": 8,
                     "steps": 80, "warmup": 8, "lr": 3e-3, "bins": 6, "bootstrap": 100, "eval_tokens": 4096},
           "full": {"corpus_bytes": 4_000_000, "layers": 4, "d_model": 128, "heads": 4, "block": 64, "batch": 16,
                    "steps": 3000, "warmup": 100, "lr": 2e-3, "bins": 14, "bootstrap": 500, "eval_tokens": 32768}},
    run=run, checks=checks, rows=rows, plot=plot,
    notes="One small model and its own learning curve (the cosine schedule shapes its tail), not Kaplan's "
          "envelope over model sizes; bytes of Python source instead of WebText. The α of a small model's learning "
          "curve is not Kaplan's α_D, which is the data-limited exponent of models large enough not to saturate.",
)
