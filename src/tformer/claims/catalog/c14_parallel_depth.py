"""Claim 14: transformers displaced RNNs because their sequential depth is constant in the sequence length,
so training uses the hardware fully (Vaswani et al. 2017, §4 and Table 1).

A tformer decoder and an LSTM language model (``torch.nn.LSTM``, the standard recurrent baseline) of
about the same parameter count, trained on the same byte windows: the median time of one training
step (forward, backward, AdamW update) at batch ``B`` and length ``T``, both alternated, for growing
``T``; throughput = B·T / time. The transformer's sequential operations per layer are O(1) (all T
positions at once); the LSTM's are O(T) (one step after another), Vaswani et al.'s Table 1.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn as nn

from tformer.claims.base import Check, Claim
from tformer.claims.common import byte_corpus, fmt, new_figure
from tformer.config import TransformerConfig
from tformer.models import build_model
from tformer.training.data import get_batch


class LSTMLM(nn.Module):
    """Embedding (V, H) -> ``layers``-layer LSTM of width H -> tied head: logits (B, T, V)."""

    def __init__(self, vocab: int, hidden: int, layers: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.lstm = nn.LSTM(hidden, hidden, layers, batch_first=True)

    def forward(self, ids, targets=None):
        h, _ = self.lstm(self.emb(ids))                                          # (B, T, H)
        logits = h @ self.emb.weight.T                                           # (B, T, V)
        return logits, nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def lstm_width(target: int, vocab: int, layers: int) -> int:
    """The LSTM width H whose parameter count (V·H + layers·(8H² + 8H)) is closest to ``target``."""
    return min(range(8, 2048), key=lambda h: abs(vocab * h + layers * (8 * h * h + 8 * h) - target))


def step_times(models: dict, data, batch: int, T: int, repeats: int) -> dict:
    """Median seconds of one training step per model at length T, the models alternated."""
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-3) for k, m in models.items()}
    samples = {k: [] for k in models}
    for r in range(repeats + 1):
        x, y = get_batch(data, batch, T, (3, r))                                  # (B, T) each
        for k, m in models.items():
            t0 = time.perf_counter()
            loss = m(x, targets=y)[1]
            opts[k].zero_grad(set_to_none=True)
            loss.backward()
            opts[k].step()
            if r:                                                                 # round 0 warms up
                samples[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in samples.items()}


def run(config: dict, progress) -> dict:
    c = config
    train, _ = byte_corpus(c["corpus_bytes"])
    cfg = TransformerConfig(vocab_size=256, n_layers=c["layers"], d_model=c["d_model"], n_heads=c["heads"],
                            context_length=max(c["lengths"]), positions="rope", dropout=0.0)
    torch.manual_seed(0)
    transformer = build_model(cfg)
    p_t = sum(p.numel() for p in transformer.parameters())
    hidden = lstm_width(p_t, 256, c["layers"])
    lstm = LSTMLM(256, hidden, c["layers"])
    p_l = sum(p.numel() for p in lstm.parameters())
    rows = []
    for T in progress(c["lengths"], "lengths"):
        t = step_times({"transformer": transformer, "lstm": lstm}, train, c["batch"], T, c["repeats"])
        rows.append({"T": T, **{f"{k}_s": v for k, v in t.items()},
                     **{f"{k}_tok_s": c["batch"] * T / v for k, v in t.items()}})
    return {"params": {"transformer": p_t, "lstm": p_l}, "lstm_hidden": hidden, "layers": c["layers"],
            "batch": c["batch"], "rows": rows, "threads": torch.get_num_threads()}


def checks(m: dict) -> list[Check]:
    r = m["rows"]
    p = m["params"]
    ratio = [x["transformer_tok_s"] / x["lstm_tok_s"] for x in r]
    lstm_flat = r[-1]["lstm_tok_s"] / r[0]["lstm_tok_s"]
    return [
        Check("equal parameters: the two models' counts within 5%",
              abs(p["transformer"] - p["lstm"]) <= 0.05 * p["transformer"],
              f"transformer {p['transformer']:,}, LSTM {p['lstm']:,}"),
        Check("the transformer trains >= 2x more tokens/s than the LSTM at every length", min(ratio) >= 2,
              ", ".join(f"T={x['T']}: {fmt(q)}x" for x, q in zip(r, ratio))),
        Check("sequential depth O(T): the LSTM's tokens/s does not rise with T (longest / shortest <= 1.3), "
              "while the transformer's step stays parallel (its time grows less than T: exponent < 1.2)",
              lstm_flat <= 1.3 and _exponent(r, "transformer_s") < 1.2,
              f"LSTM tokens/s ratio {fmt(lstm_flat)}, transformer time exponent {fmt(_exponent(r, 'transformer_s'))}"),
    ]


def _exponent(rows: list[dict], key: str) -> float:
    import math

    x = [math.log(r["T"]) for r in rows]
    y = [math.log(r[key]) for r in rows]
    mx, my = statistics.fmean(x), statistics.fmean(y)
    return sum((a - mx) * (b - my) for a, b in zip(x, y)) / sum((a - mx) ** 2 for a in x)


def rows(m: dict) -> list[tuple[str, str, str]]:
    r = m["rows"]
    return [("sequential operations per layer: self-attention / recurrent", "O(1) / O(n) (Table 1)",
             f"1 / T (the LSTM steps through T = {r[0]['T']}..{r[-1]['T']} one at a time)"),
            ("training tokens/s, transformer / LSTM (equal parameters), by T = " + " / ".join(str(x["T"]) for x in r),
             "transformer trains faster (base model: 12 h on 8 P100s, beating RNN ensembles, Table 2)",
             " / ".join(f"{x['transformer_tok_s']:,.0f} vs {x['lstm_tok_s']:,.0f}" for x in r))]


def plot(m: dict):
    fig, (a,) = new_figure(1, width=5.6)
    T = [x["T"] for x in m["rows"]]
    a.plot(T, [x["transformer_tok_s"] for x in m["rows"]], "o-", label=f"transformer ({m['params']['transformer']:,})")
    a.plot(T, [x["lstm_tok_s"] for x in m["rows"]], "s-", label=f"LSTM ({m['params']['lstm']:,})")
    a.set(xscale="log", yscale="log", xlabel="sequence length T", ylabel="training tokens / s",
          title=f"one training step, batch {m['batch']}, {m['threads']} thread(s)")
    a.legend(fontsize=8)
    return fig


CLAIM = Claim(
    name="parallel-depth", order=14, title="Constant sequential depth: transformers train faster than RNNs",
    sentence="Self-attention connects all positions with a constant number of sequential operations where a "
             "recurrent layer needs O(n), so at equal size a transformer trains on more tokens per second and "
             "uses parallel hardware fully.",
    source="Vaswani et al. 2017, Attention Is All You Need, §4 and Table 1 (sequential operations: O(1) vs O(n)), "
           "Table 2 (training cost)",
    published=[("Table 1", "sequential operations: self-attention O(1), recurrent O(n); per-layer complexity "
                           "O(n²·d) vs O(n·d²)"),
               ("Table 2", "Transformer (base) 3.3e18 training FLOPs for 27.3 BLEU vs GNMT+RL 2.3e19 for 24.6")],
    sizes={"quick": {"corpus_bytes": 200_000, "layers": 2, "d_model": 64, "heads": 4, "batch": 8,
                     "lengths": [32, 128], "repeats": 1},
           "full": {"corpus_bytes": 2_000_000, "layers": 4, "d_model": 128, "heads": 4, "batch": 16,
                    "lengths": [32, 64, 128, 256, 512, 1024], "repeats": 7}},
    run=run, checks=checks, rows=rows, plot=plot,
    notes="A CPU with 1-2 threads, where parallel width is small: on a GPU the gap is far larger. The LSTM is "
          "PyTorch's own (its CPU kernel), the transformer tformer's; throughput only, not loss per wall second.",
)
