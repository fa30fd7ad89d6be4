"""Claim 2: a layer holds 4d² in attention and 8d² in the MLP (Kaplan et al., 2020, Table 1); h heads
of width d/h cost what one head of width d costs (Vaswani et al. 2017, §3.2.2).

Measured on built models, not from the formula: a model with two layers minus the same model with one
layer is exactly one layer's parameters; within it, the parameters named for the attention
projections and for the feed-forward are summed separately, and what is left must be the two norms.

Multi-head cost: one attention layer of width d with h = 1, 4, 16 heads, its forward pass's FLOPs counted
by ``torch.utils.flop_counter`` (the math backend, whose matrix products the counter sees) on (B, n, d)
inputs, against the closed form 2·B·n·4d² (the four projections) + 2·2·B·n²·d (QKᵀ and AV over all heads:
h · n² · d/h = n²·d), which does not depend on h.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from tformer.accounting import count_parameters
from tformer.claims.base import Check, Claim
from tformer.claims.common import fmt, new_figure
from tformer.config import TransformerConfig
from tformer.models import build_model

ATTENTION_NAMES = ("qkv_proj", "q_proj", "kv_proj", "out_proj")


def layer_parameters(d: int, n_heads: int, n_kv_heads: int) -> dict:
    """Parameters of one built layer (bias-free, 4d GELU MLP), split into attention / MLP / rest."""
    def build(n_layers):
        config = TransformerConfig(d_model=d, n_heads=n_heads, n_kv_heads=n_kv_heads, n_layers=n_layers,
                                   bias=False, vocab_size=256, context_length=16)
        return config, build_model(config)

    config, one = build(1)
    _, two = build(2)
    layer = sum(p.numel() for p in two.parameters()) - sum(p.numel() for p in one.parameters())
    named = dict(two.named_parameters())
    blocks = sorted({n.split(".")[1] for n in named if n.startswith("blocks.")})
    last = [(n, p) for n, p in named.items() if n.startswith(f"blocks.{blocks[-1]}.")]
    attention = sum(p.numel() for n, p in last if any(a in n for a in ATTENTION_NAMES))
    mlp = sum(p.numel() for n, p in last if ".ffn." in n)
    acc = count_parameters(config)
    return {"d": d, "n_heads": n_heads, "n_kv_heads": n_kv_heads, "layer": layer, "attention": attention,
            "mlp": mlp, "rest": layer - attention - mlp, "accounting_layer": acc.layers // acc.n_layers}


def head_costs(d: int, n: int, batch: int, heads: list[int]) -> list[dict]:
    """Parameters and counted forward FLOPs of one attention layer of width ``d`` per head count."""
    out = []
    for h in heads:
        config = TransformerConfig(d_model=d, n_heads=h, n_layers=1, bias=False, vocab_size=256, context_length=n,
                                   attention_backend="math")
        attn = build_model(config).blocks[0].attn
        x = torch.randn(batch, n, d)                                             # (B, n, d)
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            attn(x)
        out.append({"h": h, "params": sum(p.numel() for p in attn.parameters()), "flops": counter.get_total_flops(),
                    "formula": 2 * batch * n * 4 * d * d + 4 * batch * n * n * d})
    return out


def run(config: dict, progress) -> dict:
    mha = [layer_parameters(d, max(1, d // 64), max(1, d // 64)) for d in progress(config["widths"], "widths")]
    gqa = [layer_parameters(d, h, kv) for d, h, kv in config["gqa"]]
    c = config["heads"]
    return {"mha": mha, "gqa": gqa, "heads": head_costs(c["d"], c["n"], c["batch"], c["counts"]),
            "heads_shape": c}


def checks(m: dict) -> list[Check]:
    mha, gqa = m["mha"], m["gqa"]
    return [
        Check("attention = 4d² exactly at every width", all(r["attention"] == 4 * r["d"] ** 2 for r in mha),
              ", ".join(f"d={r['d']}: {r['attention'] / r['d'] ** 2:g}d²" for r in mha)),
        Check("MLP = 8d² exactly at every width (2/3 of 12d²)", all(r["mlp"] == 8 * r["d"] ** 2 for r in mha),
              ", ".join(f"d={r['d']}: {r['mlp'] / r['d'] ** 2:g}d²" for r in mha)),
        Check("GQA attention = 2d² + 2d²·h_kv/h exactly",
              all(r["attention"] == 2 * r["d"] ** 2 + 2 * r["d"] ** 2 * r["n_kv_heads"] // r["n_heads"] for r in gqa),
              ", ".join(f"d={r['d']} h={r['n_heads']} h_kv={r['n_kv_heads']}: {r['attention'] / r['d'] ** 2:g}d²"
                        for r in gqa)),
        Check("the rest of a layer is its two norm gains (2d), and the accounting module agrees",
              all(r["rest"] == 2 * r["d"] and r["accounting_layer"] == r["layer"] for r in mha + gqa),
              ", ".join(f"d={r['d']}: rest {r['rest']}" for r in mha)),
        Check("multi-head costs what single-head costs: the same parameters and counted FLOPs for every head count, "
              "equal to 2·B·n·4d² + 4·B·n²·d",
              len({(r["params"], r["flops"]) for r in m["heads"]}) == 1
              and all(r["flops"] == r["formula"] for r in m["heads"]),
              ", ".join(f"h={r['h']}: {r['params']:,} params, {r['flops']:,} FLOPs" for r in m["heads"])),
    ]


def rows(m: dict) -> list[tuple[str, str, str]]:
    big = m["mha"][-1]
    d2 = big["d"] ** 2
    out = [(f"attention, d = {big['d']}", "4d²", f"{big['attention']:,} = {big['attention'] / d2:g}d²"),
           (f"MLP, d = {big['d']}", "8d²", f"{big['mlp']:,} = {big['mlp'] / d2:g}d²"),
           ("MLP share of attention + MLP", "2/3", fmt(big["mlp"] / (big["mlp"] + big["attention"]), 6))]
    for r in m["gqa"]:
        out.append((f"GQA attention, d = {r['d']}, h = {r['n_heads']}, h_kv = {r['n_kv_heads']}",
                    "2d² + 2d²·h_kv/h", f"{r['attention'] / r['d'] ** 2:g}d²"))
    hs = m["heads_shape"]
    out.append((f"attention FLOPs, d = {hs['d']}, n = {hs['n']}, B = {hs['batch']}, h = "
                + " / ".join(str(r["h"]) for r in m["heads"]),
                "the same for every h (§3.2.2: 'similar to that of single-head attention with full dimensionality')",
                " / ".join(f"{r['flops']:,}" for r in m["heads"])))
    return out


def plot(m: dict):
    fig, (a,) = new_figure(1)
    ds = [r["d"] for r in m["mha"]]
    a.plot(ds, [r["attention"] for r in m["mha"]], "o", label="attention (built model)")
    a.plot(ds, [r["mlp"] for r in m["mha"]], "s", label="MLP (built model)")
    a.plot(ds, [4 * d * d for d in ds], "--", color="C0", label="4d²")
    a.plot(ds, [8 * d * d for d in ds], "--", color="C1", label="8d²")
    a.set(xscale="log", yscale="log", xlabel="d_model", ylabel="parameters per layer",
          title="parameters of one layer vs width")
    a.legend(fontsize=8)
    return fig


CLAIM = Claim(
    name="parameter-accounting", order=2, title="A layer is 12d²: 4d² attention, 8d² MLP",
    sentence="An attention layer holds 4d² parameters (W_Q, W_K, W_V, W_O) and the MLP 8d², two thirds of "
             "the 12d² a layer holds; grouped-query attention shrinks W_K and W_V by h_kv/h; and h heads of width "
             "d/h cost what one head of width d costs.",
    source="Kaplan et al. 2020, Scaling Laws for Neural Language Models, Table 1 (N ≈ 12·n_layer·d² with "
           "d_attn = d, d_ff = 4d); Ainslie et al. 2023 for GQA; Vaswani et al. 2017 §3.2.2 for the heads",
    published=[("attention parameters per layer", "4·d·d_attn = 4d²"),
               ("feed-forward parameters per layer", "2·d·d_ff = 8d²"),
               ("per layer", "12d² (biases and norms neglected)"),
               ("Vaswani §3.2.2", "with d_k = d_v = d/h, the total cost is similar to single-head attention at "
                                  "full dimensionality")],
    sizes={"quick": {"widths": [64, 128, 256, 512], "gqa": [[256, 8, 2], [256, 8, 1]],
                     "heads": {"d": 256, "n": 64, "batch": 2, "counts": [1, 4, 16]}},
           "full": {"widths": [64, 128, 256, 512, 1024, 2048], "gqa": [[512, 8, 2], [512, 8, 1], [1024, 16, 4]],
                    "heads": {"d": 1024, "n": 512, "batch": 2, "counts": [1, 2, 4, 8, 16, 64]}}},
    run=run, checks=checks, rows=rows, plot=plot,
    notes="Bias-free layers (biases would add O(d)); heads of width 64. The counts come from the built models' "
          "parameters, selected by name; the accounting module's formula is only compared.",
)
