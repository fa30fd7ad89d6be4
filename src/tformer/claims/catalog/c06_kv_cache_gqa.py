"""Claim 6: the KV cache holds 2·L·n·h_kv·d_head·bytes; GQA/MQA divide it by h/h_kv, speed up decoding at
long context accordingly, and cost little quality (Ainslie et al., 2023).

(a) Bytes: the inference state a model allocates for n tokens, against the formula.
(b) Speed: one decode step's attention over an n-token cache (q of one token against K/V of h_kv heads)
through tformer's attention function, MHA / GQA / MQA alternated, medians: the part of a decode step
that reads the cache and that GQA changes.
(c) Quality: the same small decoder trained from scratch with h_kv = h, h/4 and 1; validation loss.
"""

from __future__ import annotations

import statistics
import time

import torch

from tformer.accounting import kv_cache_bytes
from tformer.ops.sdpa import scaled_dot_product_attention
from tformer.claims.base import Check, Claim
from tformer.claims.common import byte_corpus, eval_loss, fmt, new_figure, train_lm
from tformer.config import TransformerConfig
from tformer.models import build_model


def state_bytes(model, batch_size: int, n_tokens: int) -> int:
    """Bytes of the inference state ``model`` allocates for ``n_tokens`` tokens of ``batch_size`` sequences."""
    return int(model.new_state(batch_size, n_tokens).nbytes)


def decode_times(n: int, batch: int, heads: int, d_head: int, kv_heads: list[int], repeats: int) -> dict:
    """Median seconds of one decode step's attention over an ``n``-token cache, per h_kv, alternated."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, 1, d_head, generator=g)                    # (B, h, 1, d)
    caches = {kv: (torch.randn(batch, kv, n, d_head, generator=g), torch.randn(batch, kv, n, d_head, generator=g))
              for kv in kv_heads}                                            # (B, h_kv, n, d) each
    times = {kv: [] for kv in kv_heads}
    with torch.no_grad():
        for r in range(repeats + 1):
            for kv in kv_heads:
                t0 = time.perf_counter()
                scaled_dot_product_attention(q, *caches[kv])          # one query sees every key
                if r:  # the first round warms up
                    times[kv].append(time.perf_counter() - t0)
    return {kv: statistics.median(t) for kv, t in times.items()}


def run(config: dict, progress) -> dict:
    c = config
    layouts = [c["heads"], c["heads"] // 4, 1]
    bytes_rows = []
    for kv in layouts:
        cfg = TransformerConfig(vocab_size=256, n_layers=c["layers"], d_model=c["d_model"], n_heads=c["heads"],
                                n_kv_heads=kv, context_length=c["cache_tokens"], positions="rope")
        measured = state_bytes(build_model(cfg), c["cache_batch"], c["cache_tokens"])
        formula = 2 * cfg.n_layers * c["cache_tokens"] * kv * cfg.head_dim * 4 * c["cache_batch"]
        bytes_rows.append({"kv_heads": kv, "measured": measured, "formula": formula,
                           "accounting": kv_cache_bytes(cfg, c["cache_tokens"], c["cache_batch"], 4)})
    speed = decode_times(c["decode_n"], c["decode_batch"], c["decode_heads"], 64,
                         [c["decode_heads"], c["decode_heads"] // 4, 1], c["repeats"])
    train, val = byte_corpus(c["corpus_bytes"])
    quality = {}
    for kv in progress(layouts, "train h_kv"):
        cfg = TransformerConfig(vocab_size=256, n_layers=c["layers"], d_model=c["d_model"], n_heads=c["heads"],
                                n_kv_heads=kv, context_length=c["block"], positions="rope")
        model, _ = train_lm(cfg, train, steps=c["steps"], batch_size=c["batch"], block=c["block"], lr=c["lr"],
                            warmup=c["steps"] // 10, seed=0)
        quality[str(kv)] = eval_loss(model, val, c["block"], c["eval_tokens"])
    return {"heads": c["heads"], "bytes": bytes_rows, "decode_n": c["decode_n"],
            "decode_heads": c["decode_heads"], "decode_seconds": {str(k): v for k, v in speed.items()},
            "val_loss": quality}


def checks(m: dict) -> list[Check]:
    b = m["bytes"]
    t = {int(k): v for k, v in m["decode_seconds"].items()}
    h = m["decode_heads"]
    q = {int(k): v for k, v in m["val_loss"].items()}
    gqa = m["heads"] // 4
    return [
        Check("measured state bytes = 2·L·n·h_kv·d_head·4 exactly for MHA, GQA and MQA",
              all(r["measured"] == r["formula"] == r["accounting"] for r in b),
              ", ".join(f"h_kv={r['kv_heads']}: {r['measured']:,}" for r in b)),
        Check("decode attention at long context: MHA time >= 2 x MQA time, and MHA > GQA > MQA",
              t[h] >= 2 * t[1] and t[h] > t[h // 4] > t[1],
              f"MHA/GQA {fmt(t[h] / t[h // 4])}x, MHA/MQA {fmt(t[h] / t[1])}x"),
        Check("GQA (h/4 kv heads) validation loss within 0.05 nats of MHA", q[gqa] <= q[m["heads"]] + 0.05,
              f"{fmt(q[gqa], 4)} vs {fmt(q[m['heads']], 4)}"),
    ]


def rows(m: dict) -> list[tuple[str, str, str]]:
    b = {r["kv_heads"]: r["measured"] for r in m["bytes"]}
    h, hd = m["heads"], m["decode_heads"]
    t = {int(k): v for k, v in m["decode_seconds"].items()}
    q = {int(k): v for k, v in m["val_loss"].items()}
    return [
        (f"KV-cache bytes, MHA / GQA-{h // 4} / MQA (h = {h})", f"ratios 1 : {h // (h // 4)} : {h} (h/h_kv)",
         f"{b[h]:,} / {b[h // 4]:,} / {b[1]:,} (ratios 1 : {b[h] // b[h // 4]} : {b[h] // b[1]})"),
        (f"decode speed-up over MHA at n = {m['decode_n']} (h = {hd}): GQA-{hd // 4} / MQA",
         "T5-XXL, time per sample: GQA-8 5.4x, MQA 6.3x (Table 1: 1.51 s, 0.28 s, 0.24 s)",
         f"{fmt(t[hd] / t[hd // 4])}x / {fmt(t[hd] / t[1])}x (attention only)"),
        ("quality: MHA / GQA / MQA", "T5-XXL average score 47.2 / 47.1 (GQA-8) / 46.6 (Table 1, uptrained)",
         f"val loss {fmt(q[h], 4)} / {fmt(q[h // 4], 4)} / {fmt(q[1], 4)} nats (trained from scratch)"),
    ]


def plot(m: dict):
    fig, (a, b, c) = new_figure(3, width=4.0)
    kv = [r["kv_heads"] for r in m["bytes"]]
    labels = [f"h_kv={k}" for k in kv]
    a.bar(labels, [r["measured"] / 2**20 for r in m["bytes"]], color="C0", label="measured")
    a.plot(labels, [r["formula"] / 2**20 for r in m["bytes"]], "k_", ms=30, label="2·L·n·h_kv·d·4")
    a.set(ylabel="MiB", title="KV-cache bytes")
    a.legend(fontsize=8)
    t = m["decode_seconds"]
    b.bar([f"h_kv={k}" for k in t], [v * 1e3 for v in t.values()], color="C1")
    b.set(ylabel="ms (median)", title=f"decode attention, n={m['decode_n']}")
    q = m["val_loss"]
    c.bar([f"h_kv={k}" for k in q], list(q.values()), color="C2")
    c.set(ylim=(min(q.values()) - 0.2, max(q.values()) + 0.1), ylabel="val loss (nats)", title="quality")
    fig.tight_layout()
    return fig


CLAIM = Claim(
    name="kv-cache-gqa", order=6, title="KV cache bytes; GQA/MQA shrink it, speed decoding, cost little",
    sentence="The KV cache holds 2·L·n·h_kv·d_head·bytes; grouped- and multi-query attention divide it by "
             "h/h_kv, decode faster at long context accordingly, at a small cost in quality.",
    source="Ainslie et al. 2023, GQA (EMNLP), Table 1 and Fig. 3; Shazeer 2019 (MQA)",
    published=[("Table 1, T5-XXL, inference time per sample", "MHA 1.51 s, GQA-8 0.28 s, MQA 0.24 s"),
               ("Table 1, average score", "MHA 47.2, GQA-8 47.1, MQA 46.6 (uptrained from MHA)")],
    sizes={"quick": {"layers": 2, "d_model": 64, "heads": 8, "cache_tokens": 256, "cache_batch": 2,
                     "decode_n": 1024, "decode_batch": 1, "decode_heads": 16, "repeats": 3,
                     "corpus_bytes": 200_000, "block": 32, "batch": 16, "steps": 20, "lr": 3e-3, "eval_tokens": 4096},
           "full": {"layers": 2, "d_model": 64, "heads": 8, "cache_tokens": 4096, "cache_batch": 2,
                    "decode_n": 8192, "decode_batch": 4, "decode_heads": 16, "repeats": 21,
                    "corpus_bytes": 2_000_000, "block": 32, "batch": 16, "steps": 400, "lr": 2e-3,
                    "eval_tokens": 16384}},
    run=run, checks=checks, rows=rows, plot=plot,
    notes="Bytes are read from the state the model allocates. Speed is the attention over the cache of one "
          "decode step (fp32, tformer's attention function, the contenders alternated, medians) on a shared "
          "2-core CPU, not a whole model's step. Quality: byte-level models trained from scratch, not uptrained.",
)
