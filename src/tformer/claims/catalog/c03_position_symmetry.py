"""Claim 3: attention without positions is permutation-equivariant; RoPE sees relative positions only.

(a) A bidirectional encoder with ``positions="none"``: permuting the input tokens permutes the hidden
states and changes nothing else, f(P x) = P f(x). With learned positions it does not hold (control).
(b) RoPE rotates q at position p and k at position r so that their dot product depends on p - r only:
shifting both by s changes no score. A decoder with RoPE (or ALiBi) gives the same logits when every
position is shifted by s; with sinusoidal positions added to the embedding it does not (control).
(c) Vaswani et al. §3.5: for any fixed offset k, PE(p + k) is a linear function of PE(p): the rotation of
each (sin, cos) pair by k·ω_i, one orthogonal matrix M_k built from k and the frequencies alone (not from
the table), the same at every position; the best linear map of a table of random (learned-like) vectors
misses (control).
"""

from __future__ import annotations

import math

import torch

from tformer.claims.base import Check, Claim
from tformer.claims.common import fmt, new_figure
from tformer.config import TransformerConfig
from tformer.models import build_model
from tformer.nn.positions import RotaryEmbedding, sinusoidal_table


def equivariance_error(positions: str, seq_len: int, seed: int) -> float:
    """max |f(P x) - P f(x)| / max |f(x)| for an encoder with the given positions, random P."""
    torch.manual_seed(seed)
    config = TransformerConfig(causal=False, positions=positions, n_layers=2, d_model=64, n_heads=4,
                               vocab_size=100, context_length=seq_len)
    model = build_model(config).double().eval()
    ids = torch.randint(0, 100, (2, seq_len))
    perm = torch.randperm(seq_len)
    with torch.no_grad():
        h, hp = model(ids), model(ids[:, perm])                              # (2, T, C)
    return float((hp - h[:, perm]).abs().max() / h.abs().max())


def rope_shift_error(head_dim: int, shifts: list[int], seed: int) -> dict:
    """Largest relative change of q·k over shifts s of both positions, for RoPE and for added sinusoids."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 1, 1, head_dim, generator=g, dtype=torch.float64)    # (B, nh, 1, hs)
    k = torch.randn(1, 1, 1, head_dim, generator=g, dtype=torch.float64)
    rope = RotaryEmbedding(head_dim, max(shifts) + 64)
    table = sinusoidal_table(max(shifts) + 64, head_dim).double()            # (L, hs)
    p, r = torch.tensor([40]), torch.tensor([23])

    def rope_score(s):
        return float((rope(q, p + s) * rope(k, r + s)).sum())

    def sinusoid_score(s):
        return float(((q[0, 0, 0] + table[40 + s]) * (k[0, 0, 0] + table[23 + s])).sum())

    out = {}
    for name, score in (("rope", rope_score), ("sinusoidal", sinusoid_score)):
        base = score(0)
        out[name] = [abs(score(s) - base) / abs(base) for s in shifts]
    return out


def rotation(dim: int, k: int, base: float = 10000.0) -> torch.Tensor:
    """M_k of §3.5 from the frequencies alone, ω_i = base^(-2i/dim): block i maps (sin pω_i, cos pω_i) to
    (sin (p+k)ω_i, cos (p+k)ω_i) = [[cos kω_i, sin kω_i], [-sin kω_i, cos kω_i]] (sin pω_i, cos pω_i). (dim, dim)."""
    m = torch.zeros(dim, dim, dtype=torch.float64)
    for i in range(dim // 2):
        c, s = math.cos(k * base ** (-2 * i / dim)), math.sin(k * base ** (-2 * i / dim))
        m[2 * i, 2 * i], m[2 * i, 2 * i + 1], m[2 * i + 1, 2 * i], m[2 * i + 1, 2 * i + 1] = c, s, -s, c
    return m


def linear_map_error(dim: int, offsets: list[int], length: int, seed: int) -> dict:
    """Per offset k: max |M_k PE(p) - PE(p + k)| over p < length with M_k from :func:`rotation` (the same
    matrix at every p), and max |M_k M_kᵀ - I|; control: the residual of the best linear map (least
    squares, in sample) of a table of random vectors, relative to its scale."""
    table = sinusoidal_table(length + max(offsets), dim).double()              # (L, dim)
    g = torch.Generator().manual_seed(seed)
    random = torch.randn(length + max(offsets), dim, generator=g, dtype=torch.float64)
    out = {"sinusoidal": [], "orthogonality": [], "random": []}
    for k in offsets:
        m = rotation(dim, k)
        out["sinusoidal"].append(float((table[:length] @ m.T - table[k:length + k]).abs().max()))
        out["orthogonality"].append(float((m @ m.T - torch.eye(dim, dtype=m.dtype)).abs().max()))
        fit = torch.linalg.lstsq(random[:length], random[k:length + k]).solution          # (dim, dim)
        out["random"].append(float((random[:length] @ fit - random[k:length + k]).abs().max() / random.abs().max()))
    return out


def logit_shift_error(positions: str, shift: int, seed: int) -> float:
    """max |logits(positions + shift) - logits(positions)| / max |logits| of a random decoder."""
    torch.manual_seed(seed)
    config = TransformerConfig(positions=positions, n_layers=2, d_model=64, n_heads=4, vocab_size=100,
                               context_length=shift + 64)
    model = build_model(config).double().eval()
    ids = torch.randint(0, 100, (2, 32))
    with torch.no_grad():
        base, _ = model(ids, positions=torch.arange(32))
        moved, _ = model(ids, positions=torch.arange(32) + shift)
    return float((moved - base).abs().max() / base.abs().max())


def run(config: dict, progress) -> dict:
    equi = {p: max(equivariance_error(p, config["seq_len"], s) for s in range(config["seeds"]))
            for p in progress(["none", "learned", "sinusoidal"], "permutations")}
    shifts = config["shifts"]
    rope = rope_shift_error(64, shifts, seed=1)
    logits = {p: logit_shift_error(p, shifts[-1], seed=2) for p in ("rope", "alibi", "sinusoidal")}
    lin = config["linear_map"]
    linear = linear_map_error(64, lin["offsets"], lin["length"], seed=3)
    return {"equivariance": equi, "shifts": shifts, "score_shift": rope, "logit_shift": logits, "linear_map": linear,
            "linear_map_shape": lin}


def checks(m: dict) -> list[Check]:
    e, r, lg = m["equivariance"], m["score_shift"], m["logit_shift"]
    return [
        Check("no positions: |f(Px) - P f(x)| / |f(x)| < 1e-10 (float64)", e["none"] < 1e-10, f"{e['none']:.2e}"),
        Check("control, learned positions: the same error > 1e-2", e["learned"] > 1e-2, f"{e['learned']:.2e}"),
        Check("RoPE: q·k changes by < 1e-6 (relative) when both positions shift, at every shift",
              max(r["rope"]) < 1e-6, f"max {max(r['rope']):.2e}; added sinusoids: max {max(r['sinusoidal']):.2e}"),
        Check("RoPE and ALiBi decoders: logits change by < 1e-6 under a common shift; sinusoidal by > 1e-2",
              lg["rope"] < 1e-6 and lg["alibi"] < 1e-6 and lg["sinusoidal"] > 1e-2,
              f"rope {lg['rope']:.2e}, alibi {lg['alibi']:.2e}, sinusoidal {lg['sinusoidal']:.2e}"),
        Check("sinusoids: one matrix M_k, built from k and the frequencies alone, maps PE(p) to PE(p+k) at every p "
              "(error < 1e-6; the table is float32) and is orthogonal (|M Mᵀ - I| < 1e-12); the best linear map of a "
              "random table misses by > 0.1", max(m["linear_map"]["sinusoidal"]) < 1e-6
              and max(m["linear_map"]["orthogonality"]) < 1e-12 and min(m["linear_map"]["random"]) > 0.1,
              f"max error {max(m['linear_map']['sinusoidal']):.1e}, orthogonality {max(m['linear_map']['orthogonality']):.1e}, "
              f"random table {min(m['linear_map']['random']):.2f}"),
    ]


def rows(m: dict) -> list[tuple[str, str, str]]:
    e, r, lg, s = m["equivariance"], m["score_shift"], m["logit_shift"], m["shifts"]
    return [("encoder without positions: f(Px) vs P f(x), relative", "0 (exact)", f"{e['none']:.1e}"),
            ("same, learned positions (control)", "≠ 0", f"{e['learned']:.1e}"),
            (f"RoPE q·k, both positions shifted by up to {s[-1]}, relative", "0 (exact)", f"{max(r['rope']):.1e}"),
            (f"decoder logits, positions shifted by {s[-1]}: RoPE / ALiBi / sinusoidal", "0 / 0 / ≠ 0",
             f"{lg['rope']:.1e} / {lg['alibi']:.1e} / {fmt(lg['sinusoidal'])}"),
            (f"PE(p+k) vs M_k PE(p), p < {m['linear_map_shape']['length']}, "
             f"k = {', '.join(map(str, m['linear_map_shape']['offsets']))}",
             "a linear function of PE(p) (§3.5): 0", f"{max(m['linear_map']['sinusoidal']):.1e} "
             f"(random table: {fmt(min(m['linear_map']['random']))})")]


def plot(m: dict):
    fig, (a, b) = new_figure(2, width=4.8)
    e = m["equivariance"]
    names = list(e)
    a.bar(names, [max(e[n], 1e-18) for n in names], color=["C2", "C3", "C3"])
    a.set(yscale="log", ylabel="relative error", title="f(P x) vs P f(x), encoder")
    s = [max(x, 1) for x in m["shifts"]]
    for name, color in (("rope", "C2"), ("sinusoidal", "C3")):
        b.plot(s, [max(x, 1e-18) for x in m["score_shift"][name]], "o-", color=color,
               label="RoPE" if name == "rope" else "added sinusoids")
    b.set(xscale="log", yscale="log", xlabel="common shift s", ylabel="relative change of q·k",
          title="shifting both positions")
    b.legend(fontsize=8)
    fig.tight_layout()
    return fig


CLAIM = Claim(
    name="position-symmetry", order=3, title="No positions: permutation-equivariant; RoPE: relative only",
    sentence="Self-attention without position information is permutation-equivariant (it sees a set, not a "
             "sequence); a sinusoidal encoding at offset k is a fixed linear map of the encoding; with RoPE, the "
             "score of a query and a key depends only on their relative position.",
    source="Vaswani et al. 2017 §3.5 (why positions must be injected); Su et al. 2021, RoFormer §3.2, eq. (16): "
           "q_mᵀ k_n = xᵀ W_q R_{n-m} W_k x",
    published=[("f(P x) − P f(x) without positions", "0: an identity, no figure"),
               ("Vaswani §3.5", "for any fixed offset k, PE_{pos+k} can be represented as a linear function of "
                                "PE_pos"),
               ("RoPE score change under a common shift", "0: an identity, no figure")],
    sizes={"quick": {"seq_len": 24, "seeds": 2, "shifts": [0, 1, 10, 100, 1000],
                     "linear_map": {"offsets": [1, 7, 50], "length": 1024}},
           "full": {"seq_len": 128, "seeds": 8, "shifts": [0, 1, 10, 100, 1000, 10000],
                    "linear_map": {"offsets": [1, 2, 7, 50, 300, 1000], "length": 8192}}},
    run=run, checks=checks, rows=rows, plot=plot,
    notes="Random (untrained) models in float64: an identity of the architecture holds for every weight. "
          "The RoPE tables are float32, which bounds the residual error.",
)
