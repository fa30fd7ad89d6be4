"""Claim 5: Pre-LN trains without warm-up; Post-LN's gradients at initialisation grow toward the output
(Xiong et al., 2020).

(a) At initialisation, in the setting of the paper's analysis (every matrix Xavier-normal, a ReLU
feed-forward with W^{FC1}, W^{FC2} of d x d, unit-variance embeddings), the gradient norm of each
layer's second feed-forward matrix W^{FC2}, averaged over batches, in the paper's own architecture: a
6-layer encoder and 6-layer decoder translation Transformer (source: a window of text, target another);
the checks read the decoder's layers. For Post-LN the gradient grows with the layer index, for Pre-LN it
stays about the same (their Fig. 3). The same measurement is reported, unchecked, for the encoder and
for a decoder-only 12-layer stack: the two earlier versions of this claim measured only that stack, where
Post-LN's gradient came out about flat (GELU 4d feed-forward: 1.09 at layer 1, 1.03 at layer 12; the d x d
ReLU of the analysis: 1.12x from first to last, 2026-12-01), which the encoder-decoder explains: an
exploratory measurement (4 batches, d 256) before this version gave Post-LN 0.51 at the decoder's first
layer and 2.81 at its last, the encoder flat (2.54 to 2.21), the decoder-only stack 1.33x over 12 layers.
Liu et al. 2020 (Understanding the Difficulty of Training Transformers, §3) locate the growth in the
decoder too. The thresholds are those of the claim's first version, unchanged.
This version (the third) changes two things of the measurement, both from the paper, none of the checks.
(i) The shared embedding: the earlier version gave it std 1, but the output head is the same matrix and
the Xavier loop re-initialised it (std 1/√d), so the decoder's input was 1/d of unit variance and the
sinusoidal positions made up nearly all of it. Vaswani §3.4 (and fairseq, which Xiong et al. used) scale
the shared matrix by √d on the way in: std d^-1/2 times √d is the unit-variance input the docstring meant.
(ii) Fig. 3 and Theorem 1 are about the *expected* gradient, over the initialisation as well as the data:
the mean over 8 initialisations of 8 batches each, not one initialisation. An exploratory measurement
before this version (3 initialisations of 8 batches, d 256, 2026-12-01) gave Pre-LN's decoder last / first
0.60, 0.66, 0.63 (mean 0.63) in the old setting and 0.65, 0.84, 0.73 (mean of the per-layer means 0.73)
with (i); Post-LN 3.85 and 4.08. Why Pre-LN's gradient falls at all: each of its LayerNorms scales the
gradient into the residual stream by 1/‖x‖, and the stream grows with every sublayer (the lemma behind
Theorem 1's 1/√L), so the report also gives the stream's RMS after each decoder layer and the gradient
times it (about flat if that is the whole cause).
(b) Trained with a large learning rate and no warm-up (Adam, no gradient clipping), Post-LN ends worse
than Pre-LN; with a warm-up, Post-LN recovers (their Fig. 2 setting, shrunk).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tformer.claims.base import Check, Claim
from tformer.claims.common import byte_corpus, eval_loss, fmt, new_figure, train_lm
from tformer.claims.resume import part
from tformer.config import TransformerConfig
from tformer.models import build_model
from tformer.training.data import get_batch


def _config(placement: str, c: dict, layers: int, tie: bool = True) -> TransformerConfig:
    return TransformerConfig(vocab_size=256, context_length=c["block"], n_layers=layers, d_model=c["d_model"],
                             n_heads=c["heads"], norm_placement=placement, tie_embeddings=tie)


def _analysis_config(placement: str, c: dict, layers: int) -> TransformerConfig:
    """The setting of Xiong et al.'s analysis: a d x d ReLU feed-forward, untied head."""
    g = c["grad"]
    return TransformerConfig(vocab_size=256, context_length=c["block"], n_layers=layers, d_model=g["d_model"],
                             n_heads=g["heads"], d_ff=g["d_model"], activation="relu", norm_placement=placement,
                             tie_embeddings=False)


def _seq2seq_config(placement: str, c: dict, layers: int) -> TransformerConfig:
    """The paper's translation Transformer in the analysis setting: ``layers`` encoder and decoder blocks,
    sinusoidal positions, a d x d ReLU feed-forward; one embedding matrix for source, target and output,
    multiplied by √d on the way in (Vaswani §3.4; fairseq, which Xiong et al. trained with)."""
    g = c["grad"]
    return TransformerConfig(model="encoder-decoder", vocab_size=256, context_length=c["block"], n_layers=layers,
                             encoder_layers=layers, d_model=g["d_model"], n_heads=g["heads"], d_ff=g["d_model"],
                             activation="relu", norm_placement=placement, positions="sinusoidal",
                             embedding_scale=True)


def _xavier(model: nn.Module) -> None:
    """The paper's initialisation: every matrix Xavier-normal, embeddings (token, learned positions) of unit
    variance (as Vaswani's √d-scaled ones). The encoder-decoder's one shared matrix (it is also the output
    head, an ``nn.Linear`` the loop would give Xavier's std 1/√d) gets fairseq's std d^-1/2: ×√d on the
    way in makes the input unit-variance, and the logits stay O(1) on the way out."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            nn.init.xavier_normal_(module.weight)
        elif isinstance(module, nn.Embedding) or name.endswith("pos_emb") and hasattr(module, "weight"):
            nn.init.normal_(module.weight, std=1.0)
    if model.config.model == "encoder-decoder":
        nn.init.normal_(model.encoder.tok_emb.weight, std=model.config.d_model ** -0.5)


def init_gradients(placement: str, c: dict, train, layers: int, arch: str = "decoder") -> dict[str, list[float]]:
    """Per-layer ‖∂loss/∂W^{FC2}‖ at the paper's initialisation, the expectation over the initialisation and
    the data estimated by the mean over ``c['grad']['seeds']`` initialisations of ``c['grad']['batches']``
    batches each of ``(batch, block)`` byte windows (no two alike): ``{"decoder": [...]}`` for a decoder-only
    stack (``arch="decoder"``), ``{"encoder": [...], "decoder": [...]}`` for the encoder-decoder
    (``arch="seq2seq"``; the source is another window of the same text). ``"decoder_rms"``: the RMS over
    tokens and channels of the residual stream each decoder block writes (its output), averaged alike."""
    seq2seq = arch == "seq2seq"
    seeds, batches = c["grad"].get("seeds", 1), c["grad"]["batches"]
    norms = rms = None
    for seed in range(seeds):
        torch.manual_seed(seed)
        model = build_model(_seq2seq_config(placement, c, layers) if seq2seq else _analysis_config(placement, c, layers))
        _xavier(model)
        names = [n for n, _ in model.named_parameters() if n.endswith("ffn.down.weight")]   # one per layer, in order
        params = dict(model.named_parameters())
        blocks = model.decoder.blocks if seq2seq else model.blocks
        norms = torch.zeros(len(names)) if norms is None else norms
        rms = torch.zeros(len(blocks)) if rms is None else rms
        seen: list[float] = []
        for b in blocks:
            b.register_forward_hook(lambda mod, args, out: seen.append(out.detach().pow(2).mean().sqrt().item()))
        for i in range(seed * batches, (seed + 1) * batches):
            x, y = get_batch(train, c["batch"], c["block"], (7, i))             # (B, block) twice
            model.zero_grad(set_to_none=True)
            seen.clear()
            if seq2seq:
                source, _ = get_batch(train, c["batch"], c["block"], (8, i))
                loss = model(source, x, targets=y)[1]
            else:
                loss = model(x, targets=y)[1]
            loss.backward()
            norms += torch.stack([params[n].grad.norm() for n in names])
            rms += torch.tensor(seen)                                           # the decoder blocks, in order
    norms = (norms / (seeds * batches)).tolist()
    sides = {}
    for name, value in zip(names, norms):
        sides.setdefault("encoder" if name.startswith("encoder.") else "decoder", []).append(value)
    sides["decoder_rms"] = (rms / (seeds * batches)).tolist()
    return sides


def run(config: dict, progress) -> dict:
    train, val = byte_corpus(config["corpus_bytes"])
    g = config["grad"]
    # each measurement one stored part: a run stopped by a time limit resumes at the next one
    seq2seq = {p: part(progress, f"seq2seq-{p}", lambda p=p: init_gradients(p, config, train, g["seq2seq_layers"],
                                                                             "seq2seq")) for p in ("post", "pre")}
    grads = {p: seq2seq[p]["decoder"] for p in ("post", "pre")}
    encoder = {p: seq2seq[p]["encoder"] for p in ("post", "pre")}
    stream = {p: seq2seq[p]["decoder_rms"] for p in ("post", "pre")}
    stack = {p: part(progress, f"stack-{p}", lambda p=p: init_gradients(p, config, train, g["layers"])["decoder"])
             for p in ("post", "pre")}
    depth = {p: [part(progress, f"depth-{p}-{n}", lambda p=p, n=n: init_gradients(p, config, train, n)["decoder"][-1])
                 for n in config["depths"]] for p in ("post", "pre")}
    runs = {}
    for name, placement, warmup in progress([("pre, no warm-up", "pre", 0), ("post, no warm-up", "post", 0),
                                             ("post, warm-up", "post", config["warmup"])], "training"):
        def one(placement=placement, warmup=warmup) -> dict:
            model, losses = train_lm(_config(placement, config, config["train_layers"]), train, steps=config["steps"],
                                     batch_size=config["batch"], block=config["block"], lr=config["lr"],
                                     warmup=warmup, clip=None, seed=0)
            val_loss = eval_loss(model, val, config["block"], config["eval_tokens"]) if losses[-1] == losses[-1] \
                else float("nan")
            return {"losses": losses, "val_loss": val_loss}
        runs[name] = part(progress, f"train-{name}", one)
    return {"grads": grads, "encoder_grads": encoder, "decoder_rms": stream, "stack_grads": stack,
            "depths": config["depths"], "last_by_depth": depth, "runs": runs, "lr": config["lr"]}


def _growth(norms: list[float]) -> float:
    return norms[-1] / norms[0]


def _times_rms(m: dict) -> list[float]:
    """Pre-LN's decoder gradients with the 1/‖x‖ of the norms taken out: gradient x RMS of the stream."""
    return [g * r for g, r in zip(m["grads"]["pre"], m["decoder_rms"]["pre"])]


def checks(m: dict) -> list[Check]:
    post, pre = _growth(m["grads"]["post"]), _growth(m["grads"]["pre"])
    r = {k: v["val_loss"] for k, v in m["runs"].items()}
    diverged = r["post, no warm-up"] != r["post, no warm-up"]
    dpre, dpost = (_growth(m["last_by_depth"][p]) for p in ("pre", "post"))
    return [
        Check("Post-LN at init, encoder-decoder: the decoder's last layer's W^{FC2} gradient >= 1.5 x its first "
              "layer's", post >= 1.5, f"ratio {fmt(post)}"),
        Check("Pre-LN at init, encoder-decoder: the decoder's last / first layer gradient within [0.67, 1.5]",
              0.67 <= pre <= 1.5,
              f"ratio {fmt(pre)}"),
        Check("last layer's gradient vs depth (Theorem 1): Pre-LN's falls to <= 0.75 x from the shallowest to the "
              "deepest model, Post-LN's stays within [0.67, 1.5]", dpre <= 0.75 and 0.67 <= dpost <= 1.5,
              f"Pre-LN {fmt(dpre)}, Post-LN {fmt(dpost)}"),
        Check("no warm-up, large lr: Post-LN diverges or ends >= 0.05 nats above Pre-LN",
              diverged or r["post, no warm-up"] >= r["pre, no warm-up"] + 0.05,
              f"val loss post {fmt(r['post, no warm-up'], 4)} vs pre {fmt(r['pre, no warm-up'], 4)}"),
        Check("with warm-up, Post-LN ends >= 0.05 nats below Post-LN without",
              diverged or r["post, warm-up"] <= r["post, no warm-up"] - 0.05,
              f"{fmt(r['post, warm-up'], 4)} vs {fmt(r['post, no warm-up'], 4)}"),
    ]


def rows(m: dict) -> list[tuple[str, str, str]]:
    g = m["grads"]
    r = {k: v["val_loss"] for k, v in m["runs"].items()}
    enc, stack = m["encoder_grads"], m["stack_grads"]
    return [("Post-LN W^{FC2} gradient by decoder layer at init, encoder-decoder (first → last)",
             "grows with the layer index (Fig. 3)", " / ".join(fmt(x) for x in g["post"])),
            ("Pre-LN W^{FC2} gradient by decoder layer at init", "about the same in every layer (Fig. 3)",
             " / ".join(fmt(x) for x in g["pre"])),
            ("the same, encoder layers: Post-LN / Pre-LN, last / first", "(not checked)",
             f"{fmt(_growth(enc['post']))} / {fmt(_growth(enc['pre']))}"),
            ("Pre-LN: RMS of the residual stream after each decoder layer (first → last)",
             "grows with the layer (the lemma behind Theorem 1: ‖x_l‖² grows linearly in l)",
             " / ".join(fmt(x) for x in m["decoder_rms"]["pre"])),
            ("Pre-LN gradient × that RMS, last / first (a LayerNorm scales its input's gradient by 1/‖x‖)",
             "(not checked: flat if the growing stream is why the gradient falls)", fmt(_growth(_times_rms(m)))),
            (f"the same, a decoder-only stack of {len(stack['post'])} layers (no cross-attention): Post-LN / Pre-LN, "
             "last / first", "(not checked: the earlier versions' setting)",
             f"{fmt(_growth(stack['post']))} / {fmt(_growth(stack['pre']))}"),
            (f"last layer's gradient at depth {m['depths'][0]} → {m['depths'][-1]}: Post-LN / Pre-LN",
             "Theorem 1: independent of depth / shrinks like 1/√L",
             f"{fmt(m['last_by_depth']['post'][0])} → {fmt(m['last_by_depth']['post'][-1])} / "
             f"{fmt(m['last_by_depth']['pre'][0])} → {fmt(m['last_by_depth']['pre'][-1])}"),
            (f"val loss, lr {m['lr']:g}, no warm-up: Pre-LN / Post-LN", "Pre-LN trains; Post-LN needs warm-up",
             f"{fmt(r['pre, no warm-up'], 4)} / {fmt(r['post, no warm-up'], 4)}"),
            ("val loss, Post-LN with warm-up", "recovers", fmt(r["post, warm-up"], 4))]


def plot(m: dict):
    from matplotlib.ticker import NullLocator

    fig, (a, c, b) = new_figure(3, width=4.2)
    for placement, colour in (("post", "C0"), ("pre", "C1")):
        norms = m["grads"][placement]
        a.plot(range(1, len(norms) + 1), norms, "o-", color=colour, label=f"{placement}-LN, decoder")
        enc = m["encoder_grads"][placement]
        a.plot(range(1, len(enc) + 1), enc, "x:", color=colour, label=f"{placement}-LN, encoder")
        c.plot(m["depths"], m["last_by_depth"][placement], "o-", label=f"{placement}-LN")
    pre, scaled = m["grads"]["pre"], _times_rms(m)          # drawn from Pre-LN's layer-1 value, to compare slopes
    a.plot(range(1, len(scaled) + 1), [v * pre[0] / scaled[0] for v in scaled], "--", color="grey",
           label="pre-LN, decoder, x stream RMS")
    a.set(yscale="log", xlabel="layer", ylabel="‖∂loss/∂W^{FC2}‖ at init", title="encoder-decoder, at init (Fig. 3)")
    c.set(xscale="log", yscale="log", xlabel="number of layers", ylabel="last layer's ‖∂loss/∂W^{FC2}‖",
          title="last layer vs depth (Thm. 1)")
    c.set_xticks(m["depths"], [str(d) for d in m["depths"]])
    c.xaxis.set_minor_locator(NullLocator())
    a.legend(fontsize=8), c.legend(fontsize=8)
    for name, run in m["runs"].items():
        b.plot(run["losses"], label=name, lw=1)
    b.set(xlabel="step", ylabel="training loss (nats)", title=f"training, lr {m['lr']:g}, no clipping")
    b.legend(fontsize=8)
    fig.tight_layout()
    return fig


CLAIM = Claim(
    name="pre-vs-post-ln", order=5, title="Pre-LN trains without warm-up, Post-LN does not",
    sentence="At initialisation, Post-LN's gradients grow toward the output layers while Pre-LN's stay flat; "
             "so Post-LN needs a learning-rate warm-up and Pre-LN trains without one.",
    source="Xiong et al. 2020, On Layer Normalization in the Transformer Architecture (ICML), Fig. 3 (gradient "
           "norms by layer at init) and Fig. 2 / §3 (Post-LN without warm-up)",
    published=[("Fig. 3", "Post-LN: expected gradient of W^{FC2} grows with the layer index; Pre-LN: about "
                          "constant across layers"),
               ("Theorem 1", "at init, the last layer's gradient is O(d·√(ln d)) for Post-LN, independent of "
                             "depth L, and O(d·√(ln d / L)) for Pre-LN"),
               ("§3", "Post-LN trained without warm-up, or with too short a one, reaches much worse BLEU; "
                      "Pre-LN trains without warm-up")],
    sizes={"quick": {"corpus_bytes": 200_000, "d_model": 32, "heads": 2, "block": 32, "batch": 16,
                     "grad": {"d_model": 64, "heads": 4, "layers": 6, "seq2seq_layers": 3, "batches": 1, "seeds": 1}, "depths": [2, 4],
                     "train_layers": 3, "steps": 20, "warmup": 5, "lr": 1e-2, "eval_tokens": 4096},
           "full": {"corpus_bytes": 2_000_000, "d_model": 64, "heads": 4, "block": 32, "batch": 16,
                    "grad": {"d_model": 256, "heads": 4, "layers": 12, "seq2seq_layers": 6, "batches": 8, "seeds": 8}, "depths": [2, 4, 8, 16],
                    "train_layers": 6, "steps": 400, "warmup": 200, "lr": 5e-3, "eval_tokens": 16384}},
    run=run, checks=checks, rows=rows, plot=plot,
    notes="Byte-level Python source instead of the paper's WMT/IWSLT translation data. For the gradients at init, "
          "the setting of the paper's analysis (every matrix Xavier-normal, a d x d ReLU feed-forward, unit-variance "
          "embeddings: the encoder-decoder's shared matrix std d^-1/2 times √d, as Vaswani and fairseq) in the paper's "
          "6-6 encoder-decoder (d 256 at the full size; the source a window of text, the target another), the mean "
          "over 8 initialisations of 8 batches each, checked on the decoder's layers; the encoder and a decoder-only 12-layer stack (untied "
          "head) are shown unchecked, and the depth check (Theorem 1) uses decoder-only stacks. The training runs (6 layers, GELU 4d feed-forward, tformer's GPT-2 init, AdamW "
          "without gradient clipping, cosine decay) compare a large learning rate with and without a warm-up of "
          "half the run. Without warm-up at that rate Post-LN does not blow up to nan (its normalisations bound the "
          "activations): it falls back to the plateau of byte frequencies, ~2.98 nats, and stays there. The rate was "
          "picked by a sweep before this run (6 layers, 400 steps, one seed: at 3e-3 Post-LN trains without "
          "warm-up; at 1e-2 it stays on the plateau even with warm-up; at 5e-3 it stays there without warm-up and "
          "trains with it); the thresholds of the checks are those of the claim's first version.",
)
