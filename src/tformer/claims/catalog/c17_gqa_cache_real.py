"""Claim 17: grouped-query attention shrinks the KV cache by h/h_kv, measured on a real GQA model,
SmolLM2-135M-Instruct (9 query heads, 3 key/value heads: 3x), against its multi-head equivalent.

The cache per token is ``2 · L · h_kv · d_head · bytes`` (a key and a value per layer and KV head).
We measure it as allocated: the real model prefills real prompts into its own inference state, and
the bytes of the tensors every layer's cache holds (their storages, not a formula) are read at two
capacities n₁ < n₂; ``(bytes(n₂) − bytes(n₁)) / (n₂ − n₁)`` is the cost of one more token. The
multi-head equivalent (the same config with ``n_kv_heads = n_heads``: 9 KV heads) is measured the same
way through its attention layers' own ``new_state``. A third check: the GQA cache is exact, the
real model's cached decode gives the logits of a full recomputation (the saving costs nothing at
inference; GQA's quality cost, if any, is paid in training: see kv-cache-gqa).
"""

from __future__ import annotations

import dataclasses

import torch

from tformer.claims.base import Check, Claim
from tformer.claims.common import fmt, new_figure
from tformer.claims.real import prompt_ids, smollm2


def storage_bytes(state) -> int:
    """Bytes of the distinct storages behind every layer's cache tensors (what is really allocated)."""
    seen = {}
    for layer in state.layers:
        for t in (layer.k, layer.v):
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def per_token(measure, n1: int, n2: int) -> float:
    return (measure(n2) - measure(n1)) / (n2 - n1)


def run(config: dict, progress) -> dict:
    model, tok = smollm2()
    c = model.config
    n1, n2 = config["capacities"]

    def gqa_bytes(n: int) -> int:
        state = model.new_state(1, n)
        with torch.no_grad():
            model(prompt_ids(tok, 1)[0], state=state)                     # the real cache, written by real tokens
        return storage_bytes(state)

    mha_config = dataclasses.replace(c, n_kv_heads=c.n_heads)
    mha_layer = type(model.blocks[0].attn)(mha_config, 0, rope=model.blocks[0].attn.rope)

    def mha_bytes(n: int) -> int:
        states = [mha_layer.new_state(1, n) for _ in range(c.n_layers)]
        return sum(s.k.untyped_storage().nbytes() + s.v.untyped_storage().nbytes() for s in states)

    # Exactness: prefill all but the last k tokens, decode those one at a time, against one full forward.
    worst = 0.0
    for ids in progress(prompt_ids(tok, config["prompts"]), "decode vs recompute"):
        k = config["decode_tokens"]
        state = model.new_state(1, ids.shape[1])
        with torch.no_grad():
            full = model(ids)[0][0]                                         # (T, vocab)
            model(ids[:, :-k], state=state)
            for i in range(ids.shape[1] - k, ids.shape[1]):
                step = model(ids[:, i:i + 1], state=state)[0][0, -1]
                worst = max(worst, float((step - full[i]).abs().max()))
    element = torch.finfo(model.tok_emb.weight.dtype).bits // 8
    return {"layers": c.n_layers, "heads": c.n_heads, "kv_heads": c.n_kv_heads, "head_dim": c.head_dim,
            "element_bytes": element, "capacities": [n1, n2],
            "gqa_per_token": per_token(gqa_bytes, n1, n2), "mha_per_token": per_token(mha_bytes, n1, n2),
            "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "decode_error": worst, "prompts": config["prompts"]}


def formula(m: dict, kv_heads: int) -> int:
    return 2 * m["layers"] * kv_heads * m["head_dim"] * m["element_bytes"]


def checks(m: dict) -> list[Check]:
    ratio = m["mha_per_token"] / m["gqa_per_token"]
    want = m["heads"] / m["kv_heads"]
    return [
        Check("SmolLM2's allocated cache per token = 2·L·h_kv·d_head·bytes exactly", m["gqa_per_token"] == formula(m, m["kv_heads"]),
              f"{m['gqa_per_token']:,.0f} B against {formula(m, m['kv_heads']):,} B"),
        Check("multi-head equivalent / SmolLM2 cache per token = h/h_kv within 1e-9", abs(ratio - want) <= 1e-9,
              f"{ratio:.6g} against {want:g}"),
        Check("the cached decode gives a full recomputation's logits within 1e-3 (float32)", m["decode_error"] <= 1e-3,
              f"max |Δlogit| {m['decode_error']:.1e}"),
    ]


def rows(m: dict) -> list[tuple[str, str, str]]:
    ratio = m["mha_per_token"] / m["gqa_per_token"]
    crossover = m["weight_bytes"] / m["gqa_per_token"]
    return [(f"KV cache per token, SmolLM2 (h {m['heads']}, h_kv {m['kv_heads']}, {m['layers']} layers, d_head "
             f"{m['head_dim']}, float32), measured", f"2·L·h_kv·d_head·4 = {formula(m, m['kv_heads']):,} B",
             f"{m['gqa_per_token']:,.0f} B"),
            ("the same model with multi-head attention (h_kv = h), measured", f"{formula(m, m['heads']):,} B",
             f"{m['mha_per_token']:,.0f} B"),
            ("saving, MHA / GQA", f"h/h_kv = {m['heads'] / m['kv_heads']:g} (Ainslie et al. §2)", f"{ratio:.4g}x"),
            ("tokens at which SmolLM2's cache outweighs its float32 weights (one sequence)", "(see kv-cache-crossover)",
             f"{crossover:,.0f}"),
            ("cached decode against full recomputation, max |Δlogit|", "0 (exact)", f"{m['decode_error']:.1e}")]


def plot(m: dict):
    fig, (a,) = new_figure(1, width=6.0)
    n = torch.linspace(0, 8192, 65)
    for name, per, style in (("multi-head equivalent (h_kv = 9)", m["mha_per_token"], "--"),
                             ("SmolLM2, GQA (h_kv = 3)", m["gqa_per_token"], "-")):
        a.plot(n, n * per / 2**20, style, label=f"{name}: {per / 1024:.1f} KiB/token")
    a.axhline(m["weight_bytes"] / 2**20, color="grey", lw=0.8, ls=":", label="float32 weights")
    a.set(xlabel="tokens in the cache (one sequence)", ylabel="MiB", title=f"SmolLM2-135M KV cache, saving "
          f"{fmt(m['mha_per_token'] / m['gqa_per_token'])}x")
    a.legend(fontsize=8)
    fig.tight_layout()
    return fig


CLAIM = Claim(
    name="gqa-cache-real", order=17, title="GQA's KV-cache saving on SmolLM2's real shape",
    sentence="Grouped-query attention with h_kv key/value heads for h query heads stores h/h_kv times fewer "
             "cache bytes per token than multi-head attention, with the same (exact) decode.",
    source="Ainslie et al. 2023, GQA (EMNLP), §2; Shazeer 2019 (MQA)",
    published=[("§2", "GQA-G uses G key/value heads: the cache shrinks by h/G against MHA (MQA: G = 1)")],
    sizes={"quick": {"capacities": [64, 128], "prompts": 1, "decode_tokens": 2},
           "full": {"capacities": [512, 4096], "prompts": 8, "decode_tokens": 8}},
    run=run, checks=checks, rows=rows, plot=plot,
    notes="SmolLM2-135M-Instruct as trained (GQA, 9 query / 3 KV heads); its multi-head equivalent exists only as "
          "a cache shape (the same config with 9 KV heads), since no MHA SmolLM2 was trained. Bytes are the "
          "allocated storages of tformer's inference state, in float32 (bf16 would halve both). The synthetic "
          "GQA/MQA quality and decode-speed comparison is kv-cache-gqa.",
)
