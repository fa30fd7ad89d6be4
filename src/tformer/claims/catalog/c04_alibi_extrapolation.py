"""Claim 4: ALiBi extrapolates past its training length; sinusoidal positions do not (Press et al., 2022).

Four small decoders, identical but for their positions (sinusoidal, learned, RoPE, ALiBi), are trained
on byte-level Python source with windows of L tokens, then evaluated on held-out text with windows of
L, 2L, 4L and 8L tokens (non-overlapping, the same text at every length). Position tables are built to
8L so that longer inputs run at all; the learned rows past L never receive a gradient.
"""

from __future__ import annotations

import math


from tformer.claims.base import Check, Claim
from tformer.claims.common import byte_corpus, eval_loss, fmt, new_figure, train_lm
from tformer.config import TransformerConfig

SCHEMES = ("sinusoidal", "learned", "rope", "alibi")
FACTORS = (1, 2, 4, 8)


def run(config: dict, progress) -> dict:
    train, val = byte_corpus(config["corpus_bytes"])
    L = config["L"]
    ppl = {}
    for scheme in SCHEMES:
        model_config = TransformerConfig(vocab_size=256, context_length=8 * L, n_layers=config["layers"],
                                         d_model=config["d_model"], n_heads=config["heads"], positions=scheme)
        model, losses = train_lm(model_config, train, steps=config["steps"], batch_size=config["batch"], block=L,
                                 lr=config["lr"], warmup=config["steps"] // 10, seed=0, progress=progress,
                                 desc=f"train {scheme}")
        ppl[scheme] = [math.exp(eval_loss(model, val, f * L, config["eval_tokens"])) for f in FACTORS]
    return {"L": L, "factors": list(FACTORS), "ppl": ppl}


def _ratio(m: dict, scheme: str, factor: int) -> float:
    return m["ppl"][scheme][m["factors"].index(factor)] / m["ppl"][scheme][0]


def checks(m: dict) -> list[Check]:
    a8, s8 = _ratio(m, "alibi", 8), _ratio(m, "sinusoidal", 8)
    return [
        Check("ALiBi stays flat: perplexity at 8L <= 1.10 x perplexity at L", a8 <= 1.10, f"ratio {fmt(a8)}"),
        Check("sinusoidal explodes: perplexity at 8L >= 2 x perplexity at L", s8 >= 2.0, f"ratio {fmt(s8)}"),
        Check("at 8L, ALiBi's perplexity is below the sinusoidal model's",
              m["ppl"]["alibi"][-1] < m["ppl"]["sinusoidal"][-1],
              f"{fmt(m['ppl']['alibi'][-1])} vs {fmt(m['ppl']['sinusoidal'][-1])}"),
    ]


def rows(m: dict) -> list[tuple[str, str, str]]:
    L = m["L"]
    published = {"sinusoidal": "rises steeply past L", "learned": "not in Fig. 1",
                 "rope": "rises past L, slower than sinusoidal", "alibi": "flat or lower past L"}
    return [(f"{s}: perplexity at L={L}, 2L, 4L, 8L (×L)", published[s],
             " / ".join(fmt(p) for p in m["ppl"][s]) + f"  (8L/L = {fmt(_ratio(m, s, 8))})") for s in SCHEMES]


def plot(m: dict):
    from matplotlib.ticker import NullLocator

    fig, (a,) = new_figure(1)
    lengths = [f * m["L"] for f in m["factors"]]
    for s in SCHEMES:
        a.plot(lengths, m["ppl"][s], "o-", label=s)
    a.axvline(m["L"], color="gray", ls=":", label="training length L")
    a.set(xscale="log", yscale="log", xlabel="evaluation window (tokens)", ylabel="validation perplexity",
          title="extrapolation past the training length")
    a.set_xticks(lengths, [str(x) for x in lengths])
    a.xaxis.set_minor_locator(NullLocator())
    a.legend(fontsize=8)
    return fig


CLAIM = Claim(
    name="alibi-extrapolation", order=4, title="ALiBi extrapolates, sinusoids do not",
    sentence="A model trained on sequences of length L with ALiBi keeps its perplexity on inputs of 2L-8L, "
             "where sinusoidal position embeddings' perplexity explodes.",
    source="Press, Smith & Lewis 2022, Train Short, Test Long (ICLR), Fig. 1 (WikiText-103, L = 512 and 1024; "
           "exact perplexities in their appendix Tables 2-3)",
    published=[("Fig. 1", "sinusoidal, rotary and T5-bias perplexities rise as the validation input grows past L; "
                          "ALiBi's does not"),
               ("abstract", "a 1.3B model trained at L = 1024 reaches, at 2048, the perplexity of a sinusoidal "
                            "model trained at 2048")],
    sizes={"quick": {"corpus_bytes": 200_000, "L": 16, "layers": 2, "d_model": 32, "heads": 2, "steps": 30,
                     "batch": 16, "lr": 3e-3, "eval_tokens": 2048},
           "full": {"corpus_bytes": 2_000_000, "L": 32, "layers": 2, "d_model": 64, "heads": 4, "steps": 600,
                    "batch": 16, "lr": 2e-3, "eval_tokens": 16384}},
    run=run, checks=checks, rows=rows, plot=plot,
    notes="Byte-level Python source (this interpreter's standard library) instead of WikiText-103, and models "
          "of a few hundred thousand parameters instead of 247M; the same protocol: train at L, evaluate "
          "non-overlapping windows of kL tokens.",
)
