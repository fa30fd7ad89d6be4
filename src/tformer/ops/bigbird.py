"""BigBird block-sparse attention (Zaheer et al., 2020, "ITC" variant): window + global + random blocks.

The sequence is cut into ``nb = n / b`` blocks of ``b`` tokens. Query block ``i`` attends to

- its window: key blocks ``i - 1, i, i + 1``;
- the global blocks: the first and the last block (and they attend to everything);
- ``r`` random blocks, drawn per head and per query block from the blocks not already listed,
  from a seeded generator (the same seed gives the same pattern, on any machine).

Each query block gathers its ``3 + 2 + r`` key blocks, so scores are ``(B, H, nb - 2, b, (5 + r)·b)``:
O(n·(5 + r)·b) time and memory; the two global query blocks cost O(b·n). A key block listed twice
for one query block (block 1's window already contains the first block) counts once. Random
blocks count as given: HuggingFace's model, in eval mode, replaces every random block by block 0
(``transformers`` draws no random blocks at inference), so that block then weighs ``1 + r`` times in
the softmax; :func:`random_blocks` with ``mode="first"`` reproduces it for converted checkpoints.

The pattern needs ``nb >= 5 + r`` blocks to draw ``r`` distinct random blocks; like
``transformers``, the mixer uses dense attention for ``n <= (5 + 2r)·b`` and says so
(:func:`dense_reason`).
"""

from __future__ import annotations

import math

import torch

from tformer.ops.masks import masked_softmax

Tensor = torch.Tensor


def dense_reason(n: int, block: int, n_random: int) -> str | None:
    """Why a length-``n`` sequence runs dense (``None`` if block-sparse applies)."""
    if n <= (5 + 2 * n_random) * block:
        return (f"sequence length {n} <= (5 + 2·{n_random} random blocks)·{block} = {(5 + 2 * n_random) * block} "
                f"tokens: the block-sparse pattern would cover (nearly) every key, so dense attention is used")
    return None


def random_blocks(n_blocks: int, n_random: int, n_heads: int, seed: int = 0, mode: str = "seeded") -> Tensor:
    """``(H, nb, r)`` long: the random key blocks of each head's query blocks (rows 0 and nb-1 unused).

    ``mode="seeded"``: ``r`` distinct blocks outside the row's window and the global blocks, from a
    ``torch.Generator`` seeded with ``seed``. ``mode="first"``: every entry is block 0 (what
    ``transformers`` uses in eval mode).
    """
    table = torch.zeros(n_heads, n_blocks, n_random, dtype=torch.long)
    if mode == "first" or n_random == 0:
        return table
    gen = torch.Generator().manual_seed(seed)
    for h in range(n_heads):
        for i in range(1, n_blocks - 1):
            taken = {0, n_blocks - 1, i - 1, i, i + 1}
            free = torch.tensor([j for j in range(n_blocks) if j not in taken])  # (nb - |taken|,)
            table[h, i] = free[torch.randperm(len(free), generator=gen)[:n_random]]
    return table


def key_blocks(n_blocks: int, table: Tensor) -> tuple[Tensor, Tensor]:
    """The key blocks of each middle query block ``i = 1 .. nb-2``.

    Returns:
        ``idx (H, nb-2, 5 + r)``: ``[i-1, i, i+1, 0, nb-1, random...]``, and ``valid (nb-2, 5 + r)``,
        ``False`` where a global block repeats a window block.
    """
    H, _, r = table.shape
    i = torch.arange(1, n_blocks - 1)                                         # (nb-2,)
    fixed = torch.stack([i - 1, i, i + 1, torch.zeros_like(i), torch.full_like(i, n_blocks - 1)], -1)
    idx = torch.cat([fixed.expand(H, -1, -1), table[:, 1:-1]], -1)            # (H, nb-2, 5 + r)
    valid = torch.ones(n_blocks - 2, 5 + r, dtype=torch.bool)
    valid[:, 3] = i - 1 != 0                                                  # first block is in the window
    valid[:, 4] = i + 1 != n_blocks - 1                                       # last block is in the window
    return idx, valid


def bigbird_attention(q: Tensor, k: Tensor, v: Tensor, block: int, table: Tensor, *,
                      key_mask: Tensor | None = None, scale: float | None = None) -> Tensor:
    """Block-sparse attention.

    Args:
        q, k, v: ``(B, H, n, e)``, ``n`` a multiple of ``block`` with at least 3 blocks.
        block: block size ``b``.
        table: ``(H or 1, nb, r)`` random key blocks (:func:`random_blocks`).
        key_mask: ``(B, n)`` bool, ``False`` = padding.
    Returns:
        ``(B, H, n, e)``.
    """
    B, H, n, e = q.shape
    nb, b = n // block, block
    scale = 1.0 / math.sqrt(e) if scale is None else scale
    key_ok = torch.ones(B, n, dtype=torch.bool, device=q.device) if key_mask is None else key_mask.bool()
    idx, valid = key_blocks(nb, table.expand(H, -1, -1))
    idx, valid = idx.to(q.device), valid.to(q.device)
    heads = torch.arange(H, device=q.device)[:, None, None]                   # (H, 1, 1)
    kb, vb = k.view(B, H, nb, b, e), v.view(B, H, nb, b, e)
    kg = kb[:, heads, idx].flatten(3, 4)                                      # (B, H, nb-2, (5+r)·b, e)
    vg = vb[:, heads, idx].flatten(3, 4)                                      # (B, H, nb-2, (5+r)·b, e)
    ok_blocks = key_ok.view(B, nb, b)[:, idx]                                 # (B, H, nb-2, 5+r, b)
    ok = (ok_blocks & valid[None, None, :, :, None]).flatten(3, 4)           # (B, H, nb-2, (5+r)·b)
    qm = q.view(B, H, nb, b, e)[:, :, 1:-1]                                   # (B, H, nb-2, b, e)
    s = torch.matmul(qm, kg.transpose(-1, -2)) * scale                        # (B, H, nb-2, b, (5+r)·b)
    middle = torch.matmul(masked_softmax(s, ok.unsqueeze(-2)), vg)            # (B, H, nb-2, b, e)
    ends = torch.cat([q[:, :, :b], q[:, :, -b:]], dim=2)                      # (B, H, 2b, e): global rows
    g = masked_softmax(torch.matmul(ends, k.transpose(-1, -2)) * scale, key_ok[:, None, None, :])
    g = torch.matmul(g, v)                                                    # (B, H, 2b, e)
    return torch.cat([g[:, :, :b], middle.flatten(2, 3), g[:, :, b:]], dim=2)


def bigbird_mask(n: int, block: int, table: Tensor) -> Tensor:
    """The dense ``(H, n, n)`` pattern of :func:`bigbird_attention` (random blocks distinct from the
    window and global blocks, as :func:`random_blocks` draws them), for tests and explanations."""
    nb = n // block
    H = table.shape[0]
    blocks = torch.zeros(H, nb, nb, dtype=torch.bool)                         # query block x key block
    i = torch.arange(nb)
    for off in (-1, 0, 1):
        j = (i + off).clamp(0, nb - 1)
        blocks[:, i, j] = True
    blocks[:, :, [0, nb - 1]] = True
    blocks[:, [0, nb - 1], :] = True
    for h in range(H):
        for row in range(1, nb - 1):
            blocks[h, row, table[h, row]] = True
    return blocks.repeat_interleave(block, 1).repeat_interleave(block, 2)    # (H, n, n)
