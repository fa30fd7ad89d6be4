"""Claim 8: attention weights are not explanations (Jain & Wallace, 2019).

A text classification task generated here: sentences of neutral, positive and negative words; the label
says whether positive words outnumber negative ones (an odd number of sentiment words, so no ties). A
small classifier (embeddings and positions, one bidirectional tformer layer, then attention pooling with a
learned query through tformer's attention function, then a logistic output) is trained on it. On test
sentences we compare, by Kendall's τ per sentence, the pooling attention with two importance measures:
gradient × input of each token's embedding (attention held fixed, as in the paper) and leave-one-out
(the change of the output when the token is removed). Then, with the encoder states fixed, we search
for adversarial attention: a distribution as far as possible (Jensen-Shannon divergence) from the
model's own that changes the output probability by at most ε = 0.01.
"""

from __future__ import annotations

import statistics

import torch
import torch.nn as nn

from tformer.ops.sdpa import scaled_dot_product_attention
from tformer.claims.base import Check, Claim
from tformer.claims.common import fmt, kendall_tau, new_figure
from tformer.config import TransformerConfig
from tformer.models import build_model
from tformer.training.config import TrainConfig
from tformer.training.loop import fit
from tformer.training.tasks.base import Task

N_NEUTRAL, N_POSITIVE, N_NEGATIVE = 60, 10, 10
VOCAB = N_NEUTRAL + N_POSITIVE + N_NEGATIVE
EPSILON = 0.01


def make_data(n: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` sentences of ``length`` word ids and their labels (1: more positive than negative words)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, N_NEUTRAL, (n, length), generator=g)              # (n, T) neutral words
    labels = torch.zeros(n)
    for i in range(n):
        k = 2 * int(torch.randint(0, 3, (1,), generator=g)) + 1               # 1, 3 or 5 sentiment words
        slots = torch.randperm(length, generator=g)[:k]
        positive = torch.rand(k, generator=g) < 0.5
        words = torch.where(positive, N_NEUTRAL + torch.randint(0, N_POSITIVE, (k,), generator=g),
                            N_NEUTRAL + N_POSITIVE + torch.randint(0, N_NEGATIVE, (k,), generator=g))
        ids[i, slots] = words
        labels[i] = float(positive.sum() * 2 > k)
    return ids, labels


class AttentionClassifier(nn.Module):
    """Encoder layer, then attention pooling with a learned query, then a logistic output."""

    def __init__(self, d_model: int, length: int):
        super().__init__()
        self.encoder = build_model(TransformerConfig(causal=False, vocab_size=VOCAB, context_length=length,
                                                     n_layers=1, d_model=d_model, n_heads=2))
        self.query = nn.Parameter(torch.randn(d_model) / d_model ** 0.5)
        self.out = nn.Linear(d_model, 1)

    def pool(self, h: torch.Tensor, alpha: torch.Tensor | None = None):
        """``h (B, T, C)`` -> (probability ``(B,)``, attention ``(B, T)``); ``alpha`` replaces the weights."""
        if alpha is None:
            q = self.query.expand(h.shape[0], 1, -1)                          # (B, 1, C)
            context, alpha = scaled_dot_product_attention(q, h, h, backend="math", return_weights=True)
            alpha = alpha[:, 0]                                               # (B, T)
        else:
            context = (alpha.unsqueeze(-1) * h).sum(1, keepdim=True)         # (B, 1, C)
        return torch.sigmoid(self.out(context[:, 0])).squeeze(-1), alpha

    def forward(self, ids: torch.Tensor):
        return self.pool(self.encoder(ids))


class Sentiment(Task):
    """Batches of 64 training sentences, step s's drawn with the seed s; binary cross-entropy."""

    def __init__(self, ids: torch.Tensor, labels: torch.Tensor):
        self.ids, self.labels = ids, labels

    def batch(self, step: int):
        rows = torch.randint(0, len(self.ids), (64,), generator=torch.Generator().manual_seed(step))
        return self.ids[rows], self.labels[rows]                              # (64, T), (64,)

    def loss(self, forward, batch) -> torch.Tensor:
        ids, labels = batch
        return nn.functional.binary_cross_entropy(forward(ids)[0], labels)


def train_classifier(c: dict) -> AttentionClassifier:
    """The classifier trained by the training loop: Adam(W) at a constant 3e-3, no weight decay, no clipping."""
    torch.manual_seed(0)
    model = AttentionClassifier(c["d_model"], c["length"])
    settings = TrainConfig(max_steps=c["steps"], lr=3e-3, min_lr=3e-3, warmup_steps=0, weight_decay=0.0, beta1=0.9,
                           beta2=0.999, grad_clip=0.0, precision="fp32", device="cpu", seed=0,
                           eval_interval=c["steps"], progress=False)
    model, _ = fit(model, Sentiment(*make_data(c["train"], c["length"], seed=1)), settings, log=lambda message: None)
    return model


def importances(model: AttentionClassifier, ids: torch.Tensor):
    """Attention, |gradient × input| (attention detached) and leave-one-out, each ``(N, T)``."""
    captured = []

    def leaf(module, inputs, output):  # the token embeddings become a leaf whose gradient we read
        captured.append(output.detach().requires_grad_())
        return captured[-1]

    handle = model.encoder.tok_emb.register_forward_hook(leaf)
    h = model.encoder(ids)                                                    # (N, T, C)
    handle.remove()
    emb = captured[0]                                                         # (N, T, C) word embeddings
    with torch.no_grad():
        _, alpha = model.pool(h)
    p, _ = model.pool(h, alpha.detach())                                      # attention held fixed
    p.sum().backward()
    grad = (emb.grad * emb.detach()).sum(-1).abs()                            # (N, T)
    with torch.no_grad():
        loo = torch.stack([(model(torch.cat([ids[:, :t], ids[:, t + 1:]], 1))[0] - p.detach()).abs()
                           for t in range(ids.shape[1])], dim=1)              # (N, T)
    return alpha, grad, loo, h.detach(), p.detach()


def jsd(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon divergence (nats) between rows of ``a`` and ``b``; at most ln 2."""
    mid = (a + b) / 2

    def kl(x, y):
        return (x * (x.clamp_min(1e-12).log() - y.clamp_min(1e-12).log())).sum(-1)

    return (kl(a, mid) + kl(b, mid)) / 2


def adversarial(model: AttentionClassifier, h: torch.Tensor, alpha: torch.Tensor, p: torch.Tensor, steps: int):
    """Maximise JSD(α̃, α) subject to |p(α̃) - p(α)| <= ε, by Adam on α̃'s logits with a penalty.

    Returns (JSD, |Δp|) per sentence."""
    torch.manual_seed(0)
    z = (alpha.clamp_min(1e-9).log() + 0.5 * torch.randn_like(alpha)).requires_grad_()
    opt = torch.optim.Adam([z], lr=0.1)
    for _ in range(steps):
        a = torch.softmax(z, -1)
        q, _ = model.pool(h, a)
        loss = (-jsd(a, alpha) + 100 * torch.relu((q - p).abs() - EPSILON * 0.9)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        a = torch.softmax(z, -1)
        q, _ = model.pool(h, a)
        return jsd(a, alpha), (q - p).abs()


def run(config: dict, progress) -> dict:
    model = train_classifier(config)
    for p in model.parameters():
        p.requires_grad_(False)
    ids, labels = make_data(config["test"], config["length"], seed=2)
    with torch.no_grad():
        accuracy = float(((model(ids)[0] > 0.5).float() == labels).float().mean())
    alpha, grad, loo, h, p = importances(model, ids)
    tau_g = [kendall_tau(a, g) for a, g in zip(alpha.tolist(), grad.tolist())]
    tau_loo = [kendall_tau(a, g) for a, g in zip(alpha.tolist(), loo.tolist())]
    divergence, change = adversarial(model, h, alpha, p, config["adversarial_steps"])
    return {"accuracy": accuracy, "tau_grad": tau_g, "tau_loo": tau_loo, "jsd": divergence.tolist(),
            "output_change": change.tolist()}


def _summary(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.pstdev(values)


def _adversarial_share(m: dict, threshold: float = 0.4) -> float:
    ok = [j >= threshold and d <= EPSILON for j, d in zip(m["jsd"], m["output_change"])]
    return sum(ok) / len(ok)


def checks(m: dict) -> list[Check]:
    tg, tl = _summary(m["tau_grad"])[0], _summary(m["tau_loo"])[0]
    share = _adversarial_share(m)
    return [
        Check("the classifier learned the task: test accuracy >= 0.9", m["accuracy"] >= 0.9, fmt(m["accuracy"])),
        Check("attention vs gradient importance: mean Kendall τ <= 0.5", tg <= 0.5, f"τ_g = {fmt(tg)}"),
        Check("attention vs leave-one-out importance: mean Kendall τ <= 0.5", tl <= 0.5, f"τ_loo = {fmt(tl)}"),
        Check("adversarial attention: for >= 50% of sentences a distribution with JSD >= 0.4 from the model's "
              f"changes the output by <= {EPSILON}", share >= 0.5, f"{share:.0%} of sentences"),
    ]


def rows(m: dict) -> list[tuple[str, str, str]]:
    (mg, sg), (ml, sl) = _summary(m["tau_grad"]), _summary(m["tau_loo"])
    ok = [j for j, d in zip(m["jsd"], m["output_change"]) if d <= EPSILON]
    return [
        ("Kendall τ, attention vs gradients (mean ± sd)", "BiLSTM: SST 0.29 ± 0.19, IMDB 0.34 ± 0.07",
         f"{fmt(mg, 2)} ± {fmt(sg, 2)}"),
        ("Kendall τ, attention vs leave-one-out (mean ± sd)", "of the same order (Table 2)",
         f"{fmt(ml, 2)} ± {fmt(sl, 2)}"),
        (f"adversarial attention, output change <= {EPSILON}: median JSD; share with JSD >= 0.4",
         "often close to the maximum ln 2 ≈ 0.69 (§4.2)",
         f"{fmt(statistics.median(ok)) if ok else 'none'}; {_adversarial_share(m):.0%}"),
        ("test accuracy of the classifier", "(task-dependent)", fmt(m["accuracy"])),
    ]


def plot(m: dict):
    fig, (a, b) = new_figure(2, width=4.8)
    a.hist([m["tau_grad"], m["tau_loo"]], bins=20, range=(-1, 1), label=["vs gradient", "vs leave-one-out"])
    a.axvline(0.29, color="k", ls="--", lw=1, label="J&W SST τ_g (0.29)")
    a.set(xlabel="Kendall τ per sentence", ylabel="sentences", title="attention vs importance")
    a.legend(fontsize=8)
    b.scatter(m["jsd"], m["output_change"], s=8)
    b.axhline(EPSILON, color="gray", ls="--", lw=1, label=f"ε = {EPSILON}")
    b.axvline(0.693, color="k", ls=":", lw=1, label="max JSD (ln 2)")
    b.set(yscale="log", xlabel="JSD(adversarial, original attention)", ylabel="|Δ output probability|",
          title="adversarial attention")
    b.legend(fontsize=8)
    fig.tight_layout()
    return fig


CLAIM = Claim(
    name="attention-not-explanation", order=8, title="Attention is not explanation",
    sentence="Attention weights correlate only weakly with gradient and leave-one-out importance, and very "
             "different attention distributions can yield the same prediction.",
    source="Jain & Wallace 2019, Attention is not Explanation (NAACL), Table 2 (Kendall τ) and §4.2 "
           "(adversarial attention)",
    published=[("Table 2, BiLSTM encoder, τ between attention and gradients", "SST 0.29 ± 0.19, IMDB 0.34 ± 0.07 "
                "(as quoted in issue 13)"),
               ("§4.2", "adversarial attention distributions far from the original (JSD near its maximum) that "
                        "leave the prediction within ε exist for many instances")],
    sizes={"quick": {"length": 16, "d_model": 32, "train": 1000, "steps": 100, "test": 48, "adversarial_steps": 60},
           "full": {"length": 32, "d_model": 64, "train": 20000, "steps": 800, "test": 500,
                    "adversarial_steps": 400}},
    run=run, checks=checks, rows=rows, plot=plot,
    notes="A synthetic task generated offline (the paper used SST, IMDB and others) and a transformer encoder "
          "layer under the attention pooling (the paper used a BiLSTM). Gradient importance is "
          "|⟨∂p/∂e_t, e_t⟩| for the word embedding e_t with the attention held fixed; τ is τ-b over all "
          "tokens of a sentence.",
)
