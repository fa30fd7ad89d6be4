"""tformer's LoRA adapters written for an HF family whose projections are fused (Phi-3: ``qkv_proj``,
``gate_up_proj``), where PEFT puts one adapter on the fused module.

tformer adapts q, k and v (gate and up) each with its own rank-``r`` pair ``(A_p, B_p)``. Their sum on the
fused module is one LoRA of rank ``k·r`` for the ``k`` parts adapted:

    A = [A_q; A_k; A_v]                        (k r, in)
    B = blockdiag(B_q, B_k, B_v)               (rows of the fused module, k r): B_p at the rows of part p,
                                               zero rows for a part not adapted

so ``B A x = Σ_p B_p A_p x`` at each part's rows: exact, not an approximation. PEFT scales by
``lora_alpha / rank`` (``/ sqrt(rank)`` with rsLoRA), so a fused module of rank ``k·r`` is written with
``rank_pattern = k·r`` and ``alpha_pattern = k·alpha`` (``sqrt(k)·alpha``) and keeps tformer's scale.
Reading such an adapter back into tformer's split adapters is refused by
:func:`tformer.training.peft_adapter.read_adapter` (a fused ``A`` is not in general k separate ones).
"""

from __future__ import annotations

import math
import re

import torch

Tensor = torch.Tensor
KEY = re.compile(r"^(.*layers\.\d+\.)(\w+\.\w+)\.lora_([AB])\.weight$")


def fuse(tensors: dict[str, Tensor], fused: dict[str, tuple[str, ...]], sizes: dict[str, int], r: int,
         alpha: float, rslora: bool) -> tuple[dict[str, Tensor], list[str], dict, dict]:
    """PEFT's tensors, ``target_modules``, ``rank_pattern`` and ``alpha_pattern`` for the split adapters
    ``tensors`` (PEFT keys on the Llama names). ``fused``: fused HF module (``self_attn.qkv_proj``) -> its
    parts in row order; ``sizes``: each part's output rows."""
    out, groups = {}, {}
    for key, t in tensors.items():
        head, module, ab = KEY.match(key).groups()
        whole = next((f for f, parts in fused.items() if module in parts), None)
        if whole is None:
            out[key] = t
        else:
            groups.setdefault((head, whole), {})[(module, ab)] = t
    ranks = {}
    for (head, whole), got in groups.items():
        parts = fused[whole]
        present = [p for p in parts if (p, "A") in got]
        a = torch.cat([got[(p, "A")] for p in present])                                  # (k r, in)
        b = torch.zeros(sum(sizes[p] for p in parts), len(present) * r, dtype=a.dtype)   # (rows, k r)
        row = col = 0
        for p in parts:
            if p in present:
                b[row:row + sizes[p], col:col + r] = got[(p, "B")]
                col += r
            row += sizes[p]
        out[f"{head}{whole}.lora_A.weight"], out[f"{head}{whole}.lora_B.weight"] = a, b.contiguous()
        ranks[whole.split(".")[-1]] = len(present)
    targets = sorted({KEY.match(k).group(2).split(".")[-1] for k in out})
    rank_pattern = {name: k * r for name, k in ranks.items() if k > 1}
    alpha_pattern = {name: alpha * (math.sqrt(k) if rslora else k) for name, k in ranks.items() if k > 1}
    return out, targets, rank_pattern, alpha_pattern
