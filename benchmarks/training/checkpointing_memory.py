"""Peak memory and step time of the one training loop with and without activation checkpointing
(``--set checkpointing=true``), on a random-weight model of a real model's shape.

Each (method, checkpointing) runs alone in its own process: ``--warmup`` + ``--steps`` steps of
:meth:`tformer.training.loop.Loop._train_step` on batches of ``--batch`` rows of ``--context`` random
tokens whose last ``--labelled`` share of positions are targets (a chat example's answer; 1.0 = every
token, pre-training), AdamW, clip 1.0, fp32 or bf16 autocast. Peak memory is the child's max RSS
(``os.wait4``); the RSS once the model is built (before the first step) is reported beside it, so the
part a step adds is visible. s/step is the median of the timed steps.

    PYTHONPATH=src python benchmarks/training/checkpointing_memory.py --shape llama-3.2-1b --methods lora \
        --batch 4 --context 1024 --steps 1 --warmup 1 --lock-each
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.child import LOCK_EACH, memory_cells, timed_steps, worker_rows  # noqa: E402
from common.record import Run  # noqa: E402

# The public configs' dimensions (config.json of each HF repository), weights random.
SHAPES = {
    "llama-3.2-1b": dict(vocab_size=128256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, d_ff=8192,
                         rope_base=500000.0, tie_embeddings=True),
    "smollm2-135m": dict(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, d_ff=1536,
                         rope_base=100000.0, tie_embeddings=True),
}
LR = 1e-4


class RandomTokens:
    """Step s's batch: seeded random ids; targets on the last ``labelled`` share of each row."""
    tokens_per_step = 0

    def __init__(self, vocab: int, batch: int, context: int, labelled: float):
        self.vocab, self.batch_size, self.context, self.labelled = vocab, batch, context, labelled

    def pieces(self, step, dist):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, self.vocab, (self.batch_size, self.context + 1), generator=g)
        x, y = ids[:, :-1], ids[:, 1:].clone()
        y[:, :self.context - max(1, round(self.labelled * self.context))] = -100
        yield True, {"ids": x, "targets": y}, 1.0

    def loss(self, forward, batch):
        return forward(batch["ids"], batch["targets"], labelled_only=True)[1]


def worker(a) -> dict:
    from tformer.config import TransformerConfig
    from tformer.models import build_model
    from tformer.training.config import TrainConfig
    from tformer.training.lora import LoRASpec, add_lora
    from tformer.training.loop import Loop
    from tformer.machine import busy_cores
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    shape = {**SHAPES[a.shape], **({"n_layers": a.layers} if a.layers else {})}
    config = TransformerConfig(context_length=a.context, norm="rmsnorm", positions="rope", ffn="swiglu", bias=False,
                               **shape)
    with torch.no_grad():
        model = build_model(config)
    if a.method == "lora":
        add_lora(model, LoRASpec(r=16, alpha=32, targets=("q_proj", "v_proj")))
    cfg = TrainConfig(precision=a.dtype, checkpointing=a.checkpointing == "on", threads=a.threads, progress=False,
                      lr=LR, weight_decay=0.0, grad_clip=1.0, device="cpu")
    loop = Loop(model.train(), RandomTokens(config.vocab_size, a.batch, a.context, a.labelled), cfg)
    return {"params": sum(p.numel() for p in model.parameters()), "busy_cores": busy_cores(),
            **timed_steps(loop, LR, a.warmup, a.steps)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    p.add_argument("--layers", type=int, default=0, help="blocks (0 = the shape's own count)")
    p.add_argument("--methods", default="lora", help="lora, full or both (comma-separated)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--labelled", type=float, default=0.25, help="share of each row's positions that are targets")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--checkpointing", default="off,on", help="which configurations to run (off, on or both)")
    p.add_argument("--lock-each", action="store_true",
                   help="run each configuration under the benchmark gate and lock (one hold each), the parent outside")
    p.add_argument("--tag", default="")
    p.add_argument("--worker", nargs=2, metavar=("METHOD", "CHECKPOINTING"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        a.method, a.checkpointing = a.worker
        print(json.dumps(worker(a)))
        return
    run = Run()
    rows = worker_rows(__file__, a, ("shape", "layers", "batch", "context", "labelled", "steps", "warmup", "threads",
                                     "dtype"), [(m, c) for m in a.methods.split(",") for c in a.checkpointing.split(",")],
                       ("method", "checkpointing"), LOCK_EACH if a.lock_each else None)
    run.finish()
    layers = a.layers or SHAPES[a.shape]["n_layers"]
    lines = [f"# Activation checkpointing: peak memory and step time ({a.shape} shape, {layers} layers, {a.dtype})", "",
             f"Random weights of {a.shape}'s dimensions with {layers} blocks ({rows[0]['params']:,} parameters); "
             f"batch {a.batch} x context {a.context}, targets on the last {a.labelled:.0%} of each row; AdamW lr {LR:g}, "
             f"clip 1.0; {a.threads} threads; {a.warmup} untimed + {a.steps} timed steps, each configuration alone "
             f"in its own process (peak = the process's max RSS)"
             + ("; each configuration under the exclusive benchmark lock, one hold each (its own start's load in "
                "the table; the load lines above are the parent's, outside the lock)" if a.lock_each else "") + ".", "",
             "| method | checkpointing | other work at its start (cores) | trained | RSS once built MB | peak RSS MB | peak on / off | s/step (median) | s/step on / off | losses |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        off = next((x for x in rows if x["method"] == r["method"] and x["checkpointing"] == "off"), r)
        lines.append(f"| {r['method']} | {r['checkpointing']} | {r['busy_cores']:.2f} | " + memory_cells(r, off))
    run.write_result("training", f"checkpointing_memory-{a.shape}-{layers}l-{a.dtype}", a.tag, "\n".join(lines),
                     {"rows": rows, "settings": vars(a)})
    print("\n".join(lines))


if __name__ == "__main__":
    main()
