"""The server's pool through the public prefill / decode_step pair: prompts prefilled into some rows
(batched for KV caches, one at a time for other states) and decoded together, each row at its own
length, give every prompt the greedy tokens of ``generate`` run on it alone. Mixers whose state is
not a KV cache (Performer's sums, Longformer's ring, Mamba's SSM state) are covered because the pool
reaches them only through row views, which must write through to the pool."""

from __future__ import annotations

import pytest
import torch

from tformer import DecoderLM, TransformerConfig, generate
from tformer.serve.pool import KVPool

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("options", [
    dict(positions="alibi", n_kv_heads=2),
    dict(positions="rope", mixer=["performer", "attention"]),
    dict(positions="rope", mixer=["longformer", "attention"], mixer_options={"longformer": {"window": 5}}),
    dict(positions="none", mixer=["mamba", "attention"]),
], ids=["attention", "performer", "longformer", "mamba"])
def test_pool_rows_decode_like_each_prompt_alone(options):
    torch.manual_seed(0)
    model = DecoderLM(TransformerConfig(vocab_size=61, context_length=64, n_layers=2, d_model=32, n_heads=4,
                                        **options)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30)                                   # sharp: no greedy near-ties
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 61, (n,), generator=g).tolist() for n in (7, 3, 11)]
    steps = 12
    want = [generate(model, torch.tensor([p]), steps, temperature=0)[0, len(p):].tolist() for p in prompts]
    pool = KVPool(model, n_slots=4, max_len=64)
    slots = [2, 0, 3]                                                   # row 1 idles inside the range
    first = pool.prefill(slots, prompts)                                # (3, vocab)
    got, seen = [[int(t)] for t in first.argmax(-1)], [[row] for row in first]
    for _ in range(steps - 1):
        tokens = torch.zeros(4, dtype=torch.long)
        for s, out in zip(slots, got):
            tokens[s] = out[-1]
        need = max(len(p) + len(out) for p, out in zip(prompts, got))
        logits = pool.decode(tokens, need)                             # (4, vocab)
        for i, (s, out) in enumerate(zip(slots, got)):
            out.append(int(logits[s].argmax()))
            seen[i].append(logits[s])
    assert pool.batched_prefill == ("mixer" not in options)
    assert got == want
    with torch.no_grad():                                               # and the logits of one full forward
        for p, out, rows in zip(prompts, got, seen):
            full = model(torch.tensor([p + out]))[0][0]                  # (n, vocab)
            torch.testing.assert_close(torch.stack(rows), full[len(p) - 1:len(p) - 1 + steps], atol=1e-5, rtol=0)
