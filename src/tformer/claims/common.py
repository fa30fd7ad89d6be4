"""What several claims' experiments share: a byte-level corpus, its language-model task for the
training loop, evaluation, Kendall's τ and figure encoding. Everything runs offline on a CPU.
"""

from __future__ import annotations

import base64
import io
import math

import numpy as np
import torch

from tformer.models import build_model
from tformer.training.config import TrainConfig
from tformer.training.data import default_corpus_files, get_batch
from tformer.training.loop import fit
from tformer.training.tasks.base import Task


def byte_corpus(n_bytes: int, val_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """The first ``n_bytes`` of this Python's standard-library source as byte ids (vocabulary 256),
    split into a training head and a validation tail that share no text."""
    chunks, total = [], 0
    for path in default_corpus_files(max_bytes=max(n_bytes, 1 << 20)):
        chunks.append(path.read_bytes())
        total += len(chunks[-1])
        if total >= n_bytes:
            break
    data = np.frombuffer(b"\n".join(chunks)[:n_bytes], dtype=np.uint8)
    cut = int(len(data) * (1 - val_fraction))
    return data[:cut], data[cut:]


class ByteWindows(Task):
    """Next-byte prediction on random windows of ``train``: step s draws ``batch_size`` windows of
    ``block + 1`` bytes with the seed ``(seed, 0, s)``."""

    def __init__(self, train: np.ndarray, batch_size: int, block: int, seed: int):
        self.train, self.batch_size, self.block, self.seed = train, batch_size, block, seed

    def batch(self, step: int):
        return get_batch(self.train, self.batch_size, self.block, (self.seed, 0, step))   # (B, block) twice

    def loss(self, forward, batch) -> torch.Tensor:
        x, y = batch
        return forward(x, targets=y)[1]


def train_lm(config, train: np.ndarray, *, steps: int, batch_size: int, block: int, lr: float,
             warmup: int = 0, seed: int = 0, clip: float | None = 1.0, progress=None, desc: str = "train"):
    """Train ``build_model(config)`` with the training loop (:mod:`tformer.training.loop`): AdamW
    (β = 0.9, 0.95; weight decay 0.1 on matrices), a linear warm-up of ``warmup`` steps then cosine
    decay to lr/10, fp32 on the CPU, nothing written.

    Returns:
        ``(model, losses)``: the trained model (eval mode) and the training loss of every step
        (``nan`` from the first non-finite loss on: a diverged run stops there, before that update).
    """
    torch.manual_seed(seed)
    model = build_model(config)
    settings = TrainConfig(max_steps=steps, batch_size=batch_size, lr=lr, min_lr=lr / 10, warmup_steps=warmup,
                           weight_decay=0.1, beta1=0.9, beta2=0.95, grad_clip=clip or 0.0, precision="fp32",
                           device="cpu", seed=seed, eval_interval=steps, log_interval=1, progress=False)
    bar = (lambda total, initial: progress(range(total), desc)) if progress else None
    model, summary = fit(model, ByteWindows(train, batch_size, block, seed), settings, on_nonfinite="stop",
                         progress=bar, log=lambda message: None)
    losses = [r["loss"] for r in summary["history"] if "loss" in r]
    return model, losses + [math.nan] * (steps - len(losses))


@torch.no_grad()
def eval_loss(model, data: np.ndarray, length: int, max_tokens: int) -> float:
    """Mean next-token cross-entropy (nats) over non-overlapping windows of ``length`` tokens,
    covering about ``max_tokens`` predictions of ``data`` (the same text for every length)."""
    n_windows = max(1, min(max_tokens // length, (len(data) - 1) // length))
    rows = np.stack([data[i * length: i * length + length + 1] for i in range(n_windows)]).astype(np.int64)
    t = torch.from_numpy(rows)                                                # (W, length + 1)
    total = 0.0
    for chunk in t.split(max(1, 8192 // length)):
        _, loss = model(chunk[:, :-1], targets=chunk[:, 1:])
        total += loss.item() * chunk.shape[0]
    return total / n_windows


def kendall_tau(a, b) -> float:
    """Kendall's τ-b between two score vectors (ties in either count as neither concordant nor
    discordant; the denominator corrects for them), from its pairwise definition: O(n²)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    da = np.sign(a[:, None] - a[None, :])                                     # (n, n)
    db = np.sign(b[:, None] - b[None, :])
    upper = np.triu_indices(len(a), k=1)
    da, db = da[upper], db[upper]
    denom = math.sqrt(np.count_nonzero(da) * np.count_nonzero(db))
    return float((da * db).sum() / denom) if denom else float("nan")


def figure_png(fig) -> bytes:
    """A matplotlib figure as PNG bytes (closed afterwards)."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def png_data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def new_figure(ncols: int = 1, width: float = 5.2, height: float = 3.6):
    """A figure of ``ncols`` panels on the non-interactive backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height))
    return fig, (list(axes) if ncols > 1 else [axes])


def fmt(x: float, digits: int = 3) -> str:
    """A number for a table: ``nan`` for non-finite values, else ``digits`` significant digits."""
    if x is None or not math.isfinite(x):
        return "nan"
    return f"{x:.{digits}g}"
