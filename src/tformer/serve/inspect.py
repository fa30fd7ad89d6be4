"""What the playground shows for one predicted token: attention per layer and head, and attribution.

For the prediction of ``target`` from ``context (t,)``:

- **attention**: layer ``l``, head ``h``: the softmax weights of the last query (the position that
  predicts ``target``) over the ``t`` context tokens, from :meth:`DecoderLM.attention_maps`. It says
  where each head *reads*, not what the read contributes.
- **attribution**: input × gradient (Shrikumar et al., 2016): for each context token ``i``,
  ``|e_i · ∂ log p(target | context) / ∂ e_i|`` with ``e_i`` the token's embedding vector, normalised
  to sum 1. A first-order estimate of how much each token's embedding moves the prediction's
  log-probability. On block weights (Q4_1, ...) the gradient passes back through each block layer's
  dequantised weight (:class:`tformer.quant.block_linear.BlockLinear`), so the default server explains too.
  The two often disagree (Jain & Wallace, 2019: "Attention is not Explanation"),
  which is the point of showing them side by side.
- **logit lens** (:mod:`tformer.interp.lens`): the residual stream at the input of every block (and
  after the last) read through the final norm and the head: the top token there, its probability
  and the target's. Where the prediction forms, layer by layer.
- **head ablation**: ``log p(target)`` again with the chosen heads' outputs set to zero
  (:mod:`tformer.interp.patching`): what removing them changes, a causal test that attention
  weights alone cannot give.
"""

from __future__ import annotations

import torch

from tformer.generation.step import prefill
from tformer.interp.lens import logit_lens
from tformer.interp.patching import ablate_heads

Tensor = torch.Tensor


def attention_rows(model, context: Tensor) -> list[list[list[float]]]:
    """Per layer, ``(n_heads, t)``: every head's weights from the last position of ``context (t,)``;
    ``[]`` for a layer whose mixer has no attention weights (Mamba)."""
    maps = model.attention_maps(context[None])                       # n_layers x (1, nh, t, t) or None
    return [[] if m is None else m[0, :, -1, :].float().tolist() for m in maps]


def input_x_gradient(model, context: Tensor, target: int) -> tuple[Tensor, float]:
    """``(t,)`` normalised |input × gradient| per context token, and ``log p(target | context)``."""
    captured: list[Tensor] = []

    def keep(_module, _inputs, out):                                  # the token embeddings e (1, t, C)
        out.requires_grad_(True)
        captured.append(out)
        return out

    handle = model.tok_emb.register_forward_hook(keep)
    try:
        with torch.enable_grad():
            logits = prefill(model, context[None])                       # (1, vocab)
            logp = torch.log_softmax(logits[0].float(), dim=-1)[target]
            (grad,) = torch.autograd.grad(logp, captured[0])              # (1, t, C)
    finally:
        handle.remove()
    scores = (grad[0] * captured[0][0].detach()).sum(-1).abs().float()   # (t,)
    return scores / scores.sum().clamp_min(1e-12), float(logp.detach())


@torch.no_grad()
def lens_rows(model, tokenizer, context: Tensor, target: int) -> list[dict]:
    """Per block input (``n_layers + 1`` rows, the last after the final block): the logit lens's top
    token at the last position, its probability, and the target's probability and rank."""
    logp = torch.log_softmax(logit_lens(model, context[None])[:, 0, -1].float(), dim=-1)   # (L+1, vocab)
    top = logp.argmax(-1)
    rows = []
    for layer in range(logp.shape[0]):
        rows.append({"top": tokenizer.decode([int(top[layer])]), "p_top": float(logp[layer, top[layer]].exp()),
                     "p_target": float(logp[layer, target].exp()),
                     "rank": int((logp[layer] > logp[layer, target]).sum())})
    return rows


@torch.no_grad()
def ablated_logprob(model, context: Tensor, target: int, heads: list[tuple[int, int]]) -> float:
    """``log p(target | context)`` with every ``(layer, head)`` in ``heads`` zero-ablated."""
    by_layer: dict[int, list[int]] = {}
    for layer, head in heads:
        by_layer.setdefault(layer, []).append(head)
    logits = ablate_heads(model, context[None], by_layer, "zero")[0, -1]
    return float(torch.log_softmax(logits.float(), dim=-1)[target])


def explain(model, tokenizer, context_ids: list[int], target: int,
            ablate: list[tuple[int, int]] | None = None) -> dict:
    """The playground's JSON for predicting ``target`` after ``context_ids`` (and, with ``ablate``
    ``[(layer, head), ...]``, its log-probability with those heads zero-ablated)."""
    device = model.tok_emb.weight.device
    context = torch.tensor(context_ids, dtype=torch.long, device=device)   # (t,)
    attention = attention_rows(model, context)                             # L x (nh, t) or []
    attribution, logp = input_x_gradient(model, context, target)
    out = {
        "tokens": [tokenizer.decode([i]) for i in context_ids],
        "target": tokenizer.decode([target]),
        "logprob": logp,
        "n_layers": len(attention),
        "n_heads": model.config.n_heads,
        "attention": attention,
        "attribution": attribution.tolist(),
        "logit_lens": lens_rows(model, tokenizer, context, target),
    }
    if ablate:
        out["ablation"] = {"heads": [list(h) for h in ablate], "logprob": ablated_logprob(model, context, target, ablate)}
    return out
