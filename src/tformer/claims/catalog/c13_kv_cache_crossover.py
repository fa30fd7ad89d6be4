"""Claim 13: in long-context serving the KV cache, not the weights, dominates memory.

Closed form: a cache holds 2·L·n·h_kv·d_head·bytes per sequence (keys and values, every layer), so with
P parameters stored at the cache's precision the cache outgrows the weights from

    n* = P / (2 · L · h_kv · d_head · b)        tokens, for b sequences at once.

Measured: the weights' bytes (the model's parameters, tied ones once) and the inference state the
model allocates (``model.new_state(b, n).nbytes``); the measured crossover is the smallest n whose
state outweighs the weights, found by bisection on allocated states. For MHA, GQA and MQA layouts of
one small model, and for SmolLM2-135M's shape (30 layers, d 576, 9 heads, 3 KV heads of 64, vocabulary
49152, tied embeddings, SwiGLU 1536), in bf16 as it is served. ``meta: true`` builds the shape on
PyTorch's meta device (the sizes of what would be allocated, nothing allocated), for the quick size.
"""

from __future__ import annotations

import math

import torch

from tformer.claims.base import Check, Claim
from tformer.claims.common import fmt, new_figure
from tformer.config import TransformerConfig
from tformer.models import build_model

SMOLLM2 = dict(vocab_size=49152, n_layers=30, d_model=576, n_heads=9, n_kv_heads=3, head_dim=64, d_ff=1536,
               ffn="swiglu", norm="rmsnorm", positions="rope", bias=False, tie_embeddings=True, context_length=8192)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def weight_bytes(model) -> int:
    """Bytes of the distinct parameter tensors (a tied embedding counted once)."""
    return sum(p.nbytes for p in {id(p): p for p in model.parameters()}.values())


def crossover(model, batch: int, dtype, limit: int) -> int:
    """Smallest n in [1, limit] whose allocated state for ``batch`` sequences exceeds the weights' bytes."""
    weights = weight_bytes(model)
    lo, hi = 1, limit
    while lo < hi:
        mid = (lo + hi) // 2
        if model.new_state(batch, mid, dtype).nbytes > weights:
            hi = mid
        else:
            lo = mid + 1
    return lo


def measure(name: str, shape: dict, c: dict) -> dict:
    dtype = DTYPES[c["dtype"]]
    cfg = TransformerConfig(**shape)
    with torch.device("meta" if c["meta"] else "cpu"):
        model = build_model(cfg).to(dtype)
    head_dim = cfg.head_dim
    per_token = 2 * cfg.n_layers * cfg.n_kv_heads * head_dim * dtype.itemsize     # bytes per token per sequence
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    out = {"name": name, "layers": cfg.n_layers, "kv_heads": cfg.n_kv_heads, "heads": cfg.n_heads, "head_dim": head_dim,
           "params": params, "weight_bytes": weight_bytes(model), "per_token": per_token, "batches": {}}
    limit = 4 * params // (2 * cfg.n_layers * cfg.n_kv_heads * head_dim) + 4
    for b in c["batches"]:
        n_star = params / (2 * cfg.n_layers * cfg.n_kv_heads * head_dim * b)
        state = model.new_state(b, c["probe_tokens"], dtype).nbytes
        out["batches"][str(b)] = {"formula": n_star, "measured": crossover(model, b, dtype, limit),
                                  "state_bytes": state, "formula_bytes": per_token * c["probe_tokens"] * b}
    return out


def run(config: dict, progress) -> dict:
    small = config["small"]
    layouts = [("MHA", small["heads"]), ("GQA", small["heads"] // 4), ("MQA", 1)]
    shapes = [(name, dict(vocab_size=small["vocab"], n_layers=small["layers"], d_model=small["d_model"],
                          n_heads=small["heads"], n_kv_heads=kv, context_length=64, positions="rope"))
              for name, kv in layouts] + [("SmolLM2-135M", SMOLLM2)]
    rows = [measure(name, shape, config) for name, shape in progress(shapes, "shapes")]
    return {"shapes": rows, "dtype": config["dtype"], "probe_tokens": config["probe_tokens"],
            "context": SMOLLM2["context_length"]}


def checks(m: dict) -> list[Check]:
    s = m["shapes"]
    smol = s[-1]
    at_context = {b: smol["per_token"] * m["context"] * int(b) / smol["weight_bytes"] for b in smol["batches"]}
    return [
        Check("allocated state bytes = 2·L·n·h_kv·d_head·bytes·b exactly, every shape and batch",
              all(r["state_bytes"] == r["formula_bytes"] for x in s for r in x["batches"].values()),
              ", ".join(f"{x['name']}: {x['per_token']:,} B/token" for x in s)),
        Check("measured crossover = ⌊n*⌋ + 1 of the closed form n* = P / (2·L·h_kv·d_head·b), every shape and batch",
              all(r["measured"] == math.floor(r["formula"]) + 1 for x in s for r in x["batches"].values()),
              "; ".join(f"{x['name']} b={b}: {r['measured']:,} vs {fmt(r['formula'], 6)}"
                        for x in s for b, r in x["batches"].items())),
        Check("GQA/MQA cut the cache per token by exactly h/h_kv, and move the crossover out by h/h_kv times their "
              "smaller weights' share (P_x / P_MHA), within 1%",
              all(s[0]["per_token"] == x["per_token"] * s[0]["heads"] // x["kv_heads"] for x in s[1:3])
              and all(math.isclose(x["batches"]["1"]["measured"] / s[0]["batches"]["1"]["measured"],
                                   s[0]["heads"] / x["kv_heads"] * x["params"] / s[0]["params"], rel_tol=0.01)
                      for x in s[1:3]),
              ", ".join(f"{x['name']}: cache /{s[0]['per_token'] // x['per_token']}, crossover "
                        f"{fmt(x['batches']['1']['measured'] / s[0]['batches']['1']['measured'])}x" for x in s[1:3])),
        Check(f"SmolLM2-135M serving its full {m['context']}-token context to 8 sequences: the cache outweighs the "
              f"weights", at_context.get("8", 0) > 1,
              ", ".join(f"b={b}: cache {fmt(v)}x weights" for b, v in at_context.items())),
    ]


def rows(m: dict) -> list[tuple[str, str, str]]:
    out = []
    for x in m["shapes"]:
        out.append((f"{x['name']} (L {x['layers']}, h_kv {x['kv_heads']}, d_head {x['head_dim']}, "
                    f"{x['params']:,} params, {m['dtype']}): crossover n for b = " + " / ".join(x["batches"]),
                    "P / (2·L·h_kv·d_head·b) = " + " / ".join(fmt(r["formula"], 5) for r in x["batches"].values()),
                    " / ".join(f"{r['measured']:,}" for r in x["batches"].values()) + " (allocated state)"))
    return out


def plot(m: dict):
    fig, (a,) = new_figure(1, width=6.0)
    smol = m["shapes"][-1]
    n = [2 ** k for k in range(8, 16)]
    for b in smol["batches"]:
        a.plot(n, [smol["per_token"] * t * int(b) / 2**20 for t in n], label=f"KV cache, {b} sequence(s)")
        a.plot([smol["batches"][b]["measured"]], [smol["weight_bytes"] / 2**20], "ko", ms=4)
    a.axhline(smol["weight_bytes"] / 2**20, color="k", ls="--", lw=1, label=f"weights ({m['dtype']})")
    a.axvline(m["context"], color="grey", ls=":", lw=1, label="SmolLM2 context")
    a.set(xscale="log", yscale="log", xlabel="context n (tokens)", ylabel="MiB",
          title="SmolLM2-135M: KV cache against weights (dots: measured crossover)")
    a.legend(fontsize=7)
    return fig


CLAIM = Claim(
    name="kv-cache-crossover", order=13, title="Long context: the KV cache outgrows the weights",
    sentence="The KV cache grows as 2·L·n·h_kv·d_head·bytes per sequence, so beyond a context of "
             "P / (2·L·h_kv·d_head·b) tokens it, not the weights, dominates a server's memory; GQA and MQA push "
             "that point out by h/h_kv.",
    source="Pope et al. 2022, Efficiently Scaling Transformer Inference, §2-3 (the KV cache's size); Ainslie et al. "
           "2023 (GQA); Kwon et al. 2023, vLLM §2.3 (the cache dominates serving memory)",
    published=[("KV cache per token", "2 · n_layers · n_kv_heads · d_head · bytes (closed form)"),
               ("vLLM §2.3", "13B model on an A100 40GB: ~65% weights, ~30% KV cache, and the cache grows with "
                             "batch and context")],
    sizes={"quick": {"meta": True, "dtype": "bfloat16", "batches": [1, 8], "probe_tokens": 512,
                     "small": {"vocab": 256, "layers": 2, "d_model": 64, "heads": 8}},
           "full": {"meta": False, "dtype": "bfloat16", "batches": [1, 4, 8, 32], "probe_tokens": 2048,
                    "small": {"vocab": 4096, "layers": 4, "d_model": 256, "heads": 8}}},
    run=run, checks=checks, rows=rows, plot=plot,
    notes="Bytes of allocated tensors, not a process's resident memory (activations and allocator slack come on "
          "top). The quick size builds the shapes on the meta device (sizes without allocation); the full size "
          "allocates them. SmolLM2's shape, not its weights: the crossover depends on the shape only.",
)
