"""ListOps (Nangia & Bowman, 2018), the Long Range Arena's first task, generated here (nothing downloaded).

An expression is a nested list of operators over digits 0-9, its label the value (10 classes)::

    [MAX 4 3 [MIN 2 3 ] 1 0 [MED 1 5 8 9 2 ] ]   ->   5

Operators: ``MIN``, ``MAX``, ``MED`` (the median; for an even count, the lower of the two middle
values), ``SM`` (sum modulo 10). The generator follows the LRA rules: from the root, each argument
is a digit with probability ``value_p`` (0.25 in LRA) or else a new operator list, up to ``max_depth``
levels (10 in LRA), 2..``max_args`` arguments each (10 in LRA); sequences are kept when their length
lies in ``[min_len, max_len]`` (LRA: 500..2000 tokens). Smaller settings give a CPU-sized variant.

:func:`train_classifier` trains LRA's model for the task (an encoder, mean pooling, a linear head)
with the training loop (:mod:`tformer.training.loop`) and measures its test accuracy.
"""

from __future__ import annotations

import random
import statistics

import torch
import torch.nn as nn
import torch.nn.functional as F

from tformer.config import TransformerConfig
from tformer.errors import InputError
from tformer.models.encoder import EncoderModel, pool
from tformer.training.config import TrainConfig
from tformer.training.loop import fit
from tformer.training.tasks.base import Task

OPS = ("MIN", "MAX", "MED", "SM")
VOCAB = ["<pad>", "<cls>", "]", *[f"[{op}" for op in OPS], *[str(d) for d in range(10)]]
TOKEN_ID = {t: i for i, t in enumerate(VOCAB)}


def apply(op: str, args: list[int]) -> int:
    """The value of one operator over its argument values."""
    if op == "MIN":
        return min(args)
    if op == "MAX":
        return max(args)
    if op == "MED":
        return statistics.median_low(args)
    return sum(args) % 10


def tree(rng: random.Random, depth: int, max_depth: int, max_args: int, value_p: float):
    """A random expression: an int, or ``(op, [children])``."""
    if depth > 0 and (depth >= max_depth or rng.random() < value_p):
        return rng.randrange(10)
    return rng.choice(OPS), [tree(rng, depth + 1, max_depth, max_args, value_p)
                             for _ in range(rng.randint(2, max_args))]


def tokens(t) -> list[str]:
    """``[OP a b ... ]`` as a token list."""
    if isinstance(t, int):
        return [str(t)]
    op, children = t
    return [f"[{op}", *[s for c in children for s in tokens(c)], "]"]


def value(t) -> int:
    """The label, evaluated recursively on the tree."""
    return t if isinstance(t, int) else apply(t[0], [value(c) for c in t[1]])


def evaluate(toks: list[str]) -> int:
    """The label, evaluated from the token string with a stack (a second, independent evaluator)."""
    stack: list[list] = []
    result = None
    for tok in toks:
        if tok.startswith("["):
            stack.append([tok[1:]])
        elif tok == "]":
            op, *args = stack.pop()
            result = apply(op, args)
            if stack:
                stack[-1].append(result)
        elif stack:
            stack[-1].append(int(tok))
        else:                                                                # a bare digit
            result = int(tok)
    return result


def generate(n: int, *, seed: int = 0, max_depth: int = 10, max_args: int = 10, value_p: float = 0.25,
             min_len: int = 500, max_len: int = 2000) -> list[tuple[list[int], int]]:
    """``n`` examples ``(token ids with a leading <cls>, label)``, lengths in ``[min_len, max_len]``."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        t = tree(rng, 0, max_depth, max_args, value_p)
        toks = tokens(t)
        if min_len <= len(toks) + 1 <= max_len:
            out.append(([TOKEN_ID["<cls>"], *[TOKEN_ID[s] for s in toks]], value(t)))
    return out


# ---------------------------------------------------------------------- classifying with an encoder
class Classifier(nn.Module):
    """A 2-layer encoder (d 64, 4 heads, learned positions) over ``length`` tokens, mean pooling over
    the real tokens and a linear 10-way head: LRA's ListOps model at CPU size, for any mixer."""

    def __init__(self, mixer: str, options: dict | None = None, length: int = 128):
        super().__init__()
        config = TransformerConfig(vocab_size=len(VOCAB), context_length=length, n_layers=2, d_model=64, n_heads=4,
                                   d_ff=128, causal=False, positions="learned", mixer=mixer,
                                   mixer_options={mixer: options} if options else {})
        self.encoder = EncoderModel(config)
        self.head = nn.Linear(64, 10)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``ids``, ``mask`` (B, N) -> class logits (B, 10)."""
        return self.head(pool(self.encoder(ids, attention_mask=mask), mask, "mean"))


def collate(examples: list, length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids (B, length), mask (B, length), labels (B,))``, right-padded with ``<pad>`` (0)."""
    ids = torch.zeros(len(examples), length, dtype=torch.long)
    mask = torch.zeros(len(examples), length, dtype=torch.long)
    for row, (toks, _) in enumerate(examples):
        ids[row, :len(toks)] = torch.tensor(toks)
        mask[row, :len(toks)] = 1
    return ids, mask, torch.tensor([label for _, label in examples])


class ListOpsTask(Task):
    """Epochs of ``data`` in shuffled order, ``batch_size`` examples a step (an epoch's incomplete tail
    is dropped); cross-entropy of the classifier's logits. Epoch e's order is the e-th permutation
    drawn from one generator seeded with ``seed``, so step s's batch is a function of s."""

    def __init__(self, data: list, batch_size: int, length: int, seed: int = 0):
        self.data, self.batch_size, self.length = data, batch_size, length
        self.per_epoch = len(data) // batch_size
        if self.per_epoch < 1:
            raise InputError(f"{len(data)} examples do not fill one batch of {batch_size}; generate more.")
        self.rng, self.orders = torch.Generator().manual_seed(seed), []

    def batch(self, step: int):
        epoch, i = divmod(step, self.per_epoch)
        while len(self.orders) <= epoch:
            self.orders.append(torch.randperm(len(self.data), generator=self.rng))
        rows = self.orders[epoch][i * self.batch_size:(i + 1) * self.batch_size]
        return collate([self.data[j] for j in rows], self.length)

    def loss(self, forward, batch) -> torch.Tensor:
        ids, mask, labels = batch
        return F.cross_entropy(forward(ids, mask), labels)


@torch.no_grad()
def accuracy_percent(model: Classifier, test: list, length: int, batch: int = 100) -> float:
    """Percentage of ``test`` classified right."""
    model.eval()
    correct = 0
    for s in range(0, len(test), batch):
        ids, mask, y = collate(test[s:s + batch], length)
        correct += (model(ids, mask).argmax(-1) == y).sum().item()
    return 100 * correct / len(test)


def train_classifier(mixer: str, options: dict | None, train: list, test: list, steps: int, *, seed: int = 0,
                     length: int = 128, batch_size: int = 32, lr: float = 1e-3) -> tuple[Classifier, float, float, float]:
    """A :class:`Classifier` trained by the training loop for ``steps`` steps: AdamW at a constant
    ``lr`` (no warm-up, no decay), weight decay 0.01 on matrices, no clipping, fp32 on the CPU.

    Returns:
        ``(model, test accuracy %, last training loss, training seconds)``.
    """
    torch.manual_seed(seed)
    model = Classifier(mixer, options, length)
    settings = TrainConfig(max_steps=steps, batch_size=batch_size, lr=lr, min_lr=lr, warmup_steps=0, weight_decay=0.01,
                           beta1=0.9, beta2=0.999, grad_clip=0.0, precision="fp32", device="cpu", seed=seed,
                           eval_interval=steps, log_interval=1, progress=False)
    model, summary = fit(model, ListOpsTask(train, batch_size, length, seed), settings, log=lambda message: None)
    return model, accuracy_percent(model, test, length), summary["history"][-1]["loss"], summary["elapsed_s"]
