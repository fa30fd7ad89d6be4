"""QLoRA against LoRA over the float32 base: peak memory and step time of ``tformer finetune``'s step on the
built-in task's batches, each configuration alone in its own process.

A configuration is the base (``blocks``: the GGUF file's own blocks, QLoRA; ``float``: the same file widened
to float32, what ``--set qlora=false`` trains on) and activation checkpointing (off / on). Each process opens
the model as ``tformer finetune`` does (:func:`tformer.training.finetune.load_base`), puts LoRA on it, and runs
``--warmup`` + ``--steps`` steps of :meth:`tformer.training.loop.Loop._train_step` on
:class:`~tformer.training.tasks.finetune.FinetuneTask` (the same batches for every configuration); peak memory is
the process's max RSS (``os.wait4``), s/step the median of the timed steps.

    PYTHONPATH=src python benchmarks/training/qlora_memory.py --model smollm2 --steps 5
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.child import memory_cells, timed_steps, worker_rows, write_result  # noqa: E402
from common.record import Run  # noqa: E402

LR = 1e-3


def worker(a) -> dict:
    from tformer.training.finetune import FinetuneSettings, load_base, load_examples
    from tformer.training.lora import add_lora
    from tformer.training.loop import Loop
    from tformer.training.tasks.finetune import FinetuneTask
    from tformer.models.decoder import DecoderLM
    torch.set_num_threads(a.threads)
    s = FinetuneSettings(model=a.model, lora_targets="all", lora_r=16, lora_alpha=32, batch_size=a.batch,
                         n_train=200, n_test=8, max_number=999, max_length=96, threads=a.threads, progress=False,
                         precision="fp32", checkpointing=a.checkpointing == "on", lr=LR, out_dir=None)
    model, tokenizer, template, stops = load_base(a.model, blocks=a.base == "blocks")
    torch.manual_seed(0)
    add_lora(model, s.lora_spec(model))
    train, val, questions = load_examples(s, tokenizer, template, stops)
    task = FinetuneTask(train, val, s, tokenizer, stops[0], questions, stops, labelled_only=isinstance(model, DecoderLM),
                        share_prefix=True)
    loop = Loop(model.train(), task, s)
    return timed_steps(loop, LR, a.warmup, a.steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="a GGUF file (default: the built-in SmolLM2 Q4_1)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--checkpointing", default="off,on")
    p.add_argument("--tag", default="")
    p.add_argument("--worker", nargs=2, metavar=("BASE", "CHECKPOINTING"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        a.base, a.checkpointing = a.worker
        print(json.dumps(worker(a)))
        return
    run = Run()
    rows = worker_rows(__file__, a, ("model", "batch", "steps", "warmup", "threads"),
                       [(b, c) for c in a.checkpointing.split(",") for b in ("float", "blocks")], ("base", "checkpointing"))
    run.finish()
    name = "qlora_memory" + (f"-{a.tag}" if a.tag else "")
    lines = ["# QLoRA (the GGUF file's blocks) against LoRA over the float32 base: peak memory and s/step", "",
             f"{a.model}; LoRA r=16 alpha=32 on all seven projections; the built-in task's batches of {a.batch} "
             f"(shared prefix on), fp32, AdamW lr {LR:g}; {a.threads} threads; {a.warmup} untimed + {a.steps} timed "
             f"steps, each configuration alone in its own process (peak = the process's max RSS).", "",
             "| base | checkpointing | trained | RSS once built MB | peak RSS MB | peak / float base's | s/step (median) | s/step / float base's | losses |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        ref = next(x for x in rows if x["base"] == "float" and x["checkpointing"] == r["checkpointing"])
        label = "GGUF blocks (QLoRA)" if r["base"] == "blocks" else "float32 (widened)"
        lines.append(f"| {label} | {r['checkpointing']} | " + memory_cells(r, ref))
    write_result(run, name, lines, rows, vars(a))


if __name__ == "__main__":
    main()
