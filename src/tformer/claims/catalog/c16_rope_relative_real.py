"""Claim 16: on a real model's own queries and keys, RoPE's attention scores depend on p − r only
(Su et al., 2021), measured on SmolLM2-135M-Instruct.

For each prompt and each of the model's 30 layers we take the input of the layer's attention (the
normalised hidden states of the real forward pass, captured by a hook), project it with the layer's
own ``qkv_proj`` into queries ``(1, 9, T, 64)`` and keys ``(1, 3, T, 64)`` (each key head serves 3
query heads), and rotate them with the model's own rotary table. The scores
``S_s[i, j] = R(p_i + s) q_i · R(p_j + s) k_j`` for a shift ``s`` of both positions must equal
``S_0``: ``R(a)ᵀ R(b) = R(b − a)`` for rotations. The deviation is measured relative to the
largest score, ``max |S_s − S_0| / max |S_0|``, over every head. Two controls keep the test honest:
the scores rebuilt here reproduce the model's own attention weights (the real q and k, not
something else), and shifting the queries alone does change the scores.
"""

from __future__ import annotations

import torch

from tformer.claims.base import Check, Claim
from tformer.claims.common import fmt, new_figure
from tformer.claims.real import prompt_ids, smollm2


def layer_inputs(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """The input of every layer's attention in the real forward pass: ``n_layers x (1, T, C)``."""
    seen = []
    hooks = [b.attn.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach()))
             for b in model.blocks]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    return seen


def scores(attn, h: torch.Tensor, q_shift: int, k_shift: int) -> torch.Tensor:
    """``q·kᵀ`` of one layer, ``(1, nh, T, T)``, with the queries rotated at ``p + q_shift`` and the
    keys at ``p + k_shift`` (``p = 0 .. T-1``)."""
    B, T, _ = h.shape
    nh, nkv, hs = attn.n_heads, attn.n_kv_heads, attn.head_dim
    with torch.no_grad():
        qkv = attn.qkv_proj(h).view(B, T, nh + 2 * nkv, hs).transpose(1, 2)       # (B, nh+2nkv, T, hs)
        q, k, _ = qkv.split([nh, nkv, nkv], dim=1)
        pos = torch.arange(T)
        attn.rope.ensure(T + max(q_shift, k_shift) + 1)
        q, k = attn.rope(q, pos + q_shift), attn.expand(attn.rope(k, pos + k_shift))  # (B, nh, T, hs) both
        return q @ k.transpose(-1, -2)                                              # (B, nh, T, T)


def run(config: dict, progress) -> dict:
    model, tok = smollm2()
    shifts = config["shifts"]
    worst = {str(s): [0.0] * len(model.blocks) for s in shifts}          # per shift, per layer
    control = [float("inf")] * len(model.blocks)
    weights_error = 0.0
    for ids in progress(prompt_ids(tok, config["prompts"]), "prompts"):
        T = ids.shape[1]
        maps = model.attention_maps(ids)                                    # n_layers x (1, nh, T, T)
        for layer, (block, h) in enumerate(zip(model.blocks, layer_inputs(model, ids))):
            attn = block.attn
            s0 = scores(attn, h, 0, 0)
            scale = float(s0.abs().max())
            causal = torch.ones(T, T, dtype=torch.bool).tril()
            mine = torch.softmax((s0 / attn.head_dim ** 0.5).masked_fill(~causal, float("-inf")), dim=-1)
            weights_error = max(weights_error, float((mine - maps[layer]).abs().max()))
            for s in shifts:
                worst[str(s)][layer] = max(worst[str(s)][layer], float((scores(attn, h, s, s) - s0).abs().max()) / scale)
            moved = float((scores(attn, h, 1, 0) - s0).abs().max()) / scale
            control[layer] = min(control[layer], moved)
    return {"shifts": shifts, "worst": worst, "control": control, "weights_error": weights_error,
            "prompts": config["prompts"], "layers": len(model.blocks), "heads": model.config.n_heads,
            "kv_heads": model.config.n_kv_heads}


def checks(m: dict) -> list[Check]:
    worst = max(max(v) for v in m["worst"].values())
    return [
        Check("both positions shifted (up to the largest shift): max |S_s − S_0| / max |S_0| <= 1e-5 in every layer "
              "and head (float32; the rotary tables are float32 roundings of float64 angles)", worst <= 1e-5,
              f"worst {worst:.1e}"),
        Check("control: the queries alone shifted by 1 change the scores by >= 1e-2 (relative) in every layer",
              min(m["control"]) >= 1e-2, f"smallest change {fmt(min(m['control']))}"),
        Check("the scores rebuilt from the hooked inputs give the model's own attention weights within 1e-5",
              m["weights_error"] <= 1e-5, f"max |Δweight| {m['weights_error']:.1e}"),
    ]


def rows(m: dict) -> list[tuple[str, str, str]]:
    out = [(f"both positions shifted by {s}: worst relative change of q·k over {m['layers']} layers × {m['heads']} heads",
            "0 (an identity: R(a)ᵀR(b) = R(b − a))", f"{max(v):.1e}") for s, v in m["worst"].items()]
    out.append(("queries alone shifted by 1 (control): smallest relative change over layers", "≠ 0",
                fmt(min(m["control"]))))
    out.append(("rebuilt softmax(q·kᵀ/√d) against the model's attention weights, max |Δ|", "0", f"{m['weights_error']:.1e}"))
    return out


def plot(m: dict):
    fig, (a,) = new_figure(1, width=6.4)
    layers = range(1, m["layers"] + 1)
    for s, v in m["worst"].items():
        a.plot(layers, [max(x, 1e-12) for x in v], "o-", ms=3, label=f"both shifted by {s}")
    a.plot(layers, m["control"], "k--", label="queries alone shifted by 1 (control)")
    a.axhline(1e-5, color="grey", lw=0.8, ls=":")
    a.set(yscale="log", xlabel="layer", ylabel="max |ΔS| / max |S|",
          title=f"SmolLM2-135M, real q/k, {m['prompts']} prompts")
    a.legend(fontsize=8)
    fig.tight_layout()
    return fig


CLAIM = Claim(
    name="rope-relative-real", order=16, title="RoPE depends only on p − r, on SmolLM2's real q and k",
    sentence="With rotary positions, a query at p and a key at r score q·k as a function of p − r only: moving "
             "both positions leaves every attention score of a real pretrained model unchanged.",
    source="Su et al. 2021, RoFormer, §3.4.2 (eq. 16: R(m)ᵀR(n) = R(n − m))",
    published=[("eq. 16", "q_mᵀ k_n = xᵀ W_q R(n − m) W_k x: a function of n − m only (exact)")],
    sizes={"quick": {"prompts": 2, "shifts": [1, 1000]},
           "full": {"prompts": 16, "shifts": [1, 100, 1000, 4000]}},
    run=run, checks=checks, rows=rows, plot=plot,
    notes="SmolLM2-135M-Instruct (the built-in smollm2: Q4_1 GGUF dequantised to float32), 30 layers, 9 query "
          "and 3 key/value heads of 64, rotary base 100000, on real prompts (prose, code, a chat turn). The "
          "synthetic version of this property is in position-symmetry; this one uses the weights of a real model.",
)
