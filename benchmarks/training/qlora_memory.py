"""QLoRA against LoRA over the float32 base: peak memory and step time of ``tformer finetune``'s step on the
built-in task's batches, each configuration alone in its own process.

A configuration is the base (``blocks``: the GGUF file's own blocks, QLoRA; ``float``: the same file widened
to float32, what ``--set qlora=false`` trains on) and activation checkpointing (off / on / ``trim``: on with
``--set trim_heap=true``). Each process opens
the model as ``tformer finetune`` does (:func:`tformer.training.finetune.load_base`), puts LoRA on it, and runs
``--warmup`` + ``--steps`` steps of :meth:`tformer.training.loop.Loop._train_step` on
:class:`~tformer.training.tasks.finetune.FinetuneTask` (the same batches for every configuration); peak memory is
the process's max RSS (``os.wait4``), s/step the median of the timed steps. With ``--rounds N`` the configurations
run N times, each round in the other order (float first, then blocks first, ...), so a change of load hits both.

Where the memory goes (each worker): the resident set (``VmRSS``, of it ``RssAnon`` and ``RssFile``) after
importing torch, after opening the model, after LoRA and the data, after building the loop (its optimizer) and
after the steps, and the bytes autograd keeps for the backward in the first step (``saved_tensors_hooks``:
distinct storages that are not the model's parameters or buffers), by the source line that saved them.

    PYTHONPATH=src python benchmarks/training/qlora_memory.py --model smollm2 --steps 5 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.child import memory_cells, timed_steps, worker_rows  # noqa: E402
from common.record import Run  # noqa: E402

LR = 1e-3


def rss() -> dict[str, float]:
    """``VmRSS``, ``RssAnon``, ``RssFile`` and ``VmHWM`` (the peak since the last reset) of this process, MB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                out[key] = int(line.split()[1]) / 1024
    return out


def saved_for_backward(loop, lr: float) -> tuple[float, dict[str, float]]:
    """One training step (the first warm-up step), counting the distinct storages autograd saves for the
    backward that are not the model's own tensors: ``(MB, {source line: MB})``."""
    import traceback

    own = {t.untyped_storage().data_ptr() for t in list(loop.model.parameters()) + list(loop.model.buffers())}
    seen: dict[int, int] = {}
    by_site: dict[str, float] = {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in own and key not in seen:
            seen[key] = t.untyped_storage().nbytes()
            frame = next((f for f in reversed(traceback.extract_stack()) if "/tformer/" in f.filename), None)
            site = f"{frame.filename.split('/tformer/')[-1]}:{frame.lineno}" if frame else "torch"
            by_site[site] = by_site.get(site, 0.0) + seen[key] / 2**20
        return t
    loop.step = 0
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loop._train_step(lr)
    top = dict(sorted(by_site.items(), key=lambda kv: -kv[1])[:8])
    return sum(seen.values()) / 2**20, {"loss": loss, **{k: round(v, 1) for k, v in top.items()}}


def worker(a) -> dict:
    phases = {"torch imported": rss()}
    from tformer.training.finetune import FinetuneSettings, load_base, load_examples
    from tformer.training.lora import add_lora
    from tformer.training.loop import Loop
    from tformer.training.tasks.finetune import FinetuneTask
    from tformer.models.decoder import DecoderLM
    phases["tformer imported"] = rss()
    torch.set_num_threads(a.threads)
    s = FinetuneSettings(model=a.model, lora_targets="all", lora_r=16, lora_alpha=32, batch_size=a.batch,
                         n_train=200, n_test=8, max_number=999, max_length=96, threads=a.threads, progress=False,
                         precision="fp32", checkpointing=a.checkpointing in ("on", "trim"),
                         trim_heap=a.checkpointing == "trim", lr=LR, out_dir=None)
    model, tokenizer, template, stops = load_base(a.model, blocks=a.base == "blocks")
    phases["model opened"] = rss()
    torch.manual_seed(0)
    add_lora(model, s.lora_spec(model))
    train, val, questions = load_examples(s, tokenizer, template, stops)
    task = FinetuneTask(train, val, s, tokenizer, stops[0], questions, stops, labelled_only=isinstance(model, DecoderLM),
                        share_prefix=True)
    phases["LoRA, data"] = rss()
    loop = Loop(model.train(), task, s)
    phases["loop built (optimizer)"] = rss()
    built = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with open("/proc/self/clear_refs", "w") as f:            # VmHWM := VmRSS: the steps' own peak from here
        f.write("5")
    saved, sites = saved_for_backward(loop, LR)              # the first warm-up step
    out = {**timed_steps(loop, LR, a.warmup, a.steps, first=1), "rss_built_mb": built}
    phases["after the steps"] = rss()
    out["steps_peak_mb"] = rss()["VmHWM"]
    out["losses"] = [sites.pop("loss")] + out["losses"]
    return {**out, "phases": phases, "saved_mb": saved, "saved_by_site": sites,
            "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="a GGUF file (default: the built-in SmolLM2 Q4_1)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--checkpointing", default="off,on,trim",
                   help="off, on, trim (on with trim_heap=true: the heap's free pages handed back before each block)")
    p.add_argument("--rounds", type=int, default=1, help="run the configurations this many times, alternating their order")
    p.add_argument("--tag", default="")
    p.add_argument("--worker", nargs=2, metavar=("BASE", "CHECKPOINTING"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        a.base, a.checkpointing = a.worker
        print(json.dumps(worker(a)))
        return
    run = Run()
    rows = []
    for k in range(a.rounds):                       # float first, then blocks first, ...
        bases = ("float", "blocks") if k % 2 == 0 else ("blocks", "float")
        for r in worker_rows(__file__, a, ("model", "batch", "steps", "warmup", "threads"),
                             [(b, c) for c in a.checkpointing.split(",") for b in bases], ("base", "checkpointing")):
            rows.append({"round": k + 1, **r})
    run.finish()
    lines = ["# QLoRA (the GGUF file's blocks) against LoRA over the float32 base: peak memory and s/step", "",
             f"{a.model}; LoRA r=16 alpha=32 on all seven projections; the built-in task's batches of {a.batch} "
             f"(shared prefix on), fp32, AdamW lr {LR:g}; {a.threads} threads; {a.warmup} untimed + {a.steps} timed "
             f"steps, each configuration alone in its own process (peak = the process's max RSS); {a.rounds} "
             f"round(s), the order alternated.", "",
             "| round | base | checkpointing | trained | RSS once built MB | peak RSS MB | peak / float base's | s/step (median) | s/step / float base's | losses |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        ref = next(x for x in rows if x["base"] == "float" and x["checkpointing"] == r["checkpointing"]
                   and x["round"] == r["round"])
        label = "GGUF blocks (QLoRA)" if r["base"] == "blocks" else "float32 (widened)"
        lines.append(f"| {r['round']} | {label} | {r['checkpointing']} | " + memory_cells(r, ref))
    lines += ["", "Where the memory goes (round 1): resident set after each phase, MB (of it anonymous / file-backed), "
              "the peak of the steps alone (`VmHWM`, reset once the loop is built: the float base's opening excluded), "
              "and what autograd keeps for the backward in the first step (distinct storages, not the model's).", "",
              "| base | checkpointing | " + " | ".join(rows[0]["phases"]) + " | peak | the steps' own peak | kept for the backward | by source line |",
              "|---|---|" + "---:|" * (len(rows[0]["phases"]) + 3) + "---|"]
    for r in rows:
        if r["round"] == 1:
            cells = [f"{v['VmRSS']:,.0f} ({v['RssAnon']:,.0f} / {v['RssFile']:,.0f})" for v in r["phases"].values()]
            sites = ", ".join(f"{k} {v:g}" for k, v in r["saved_by_site"].items())
            lines.append(f"| {r['base']} | {r['checkpointing']} | " + " | ".join(cells) +
                         f" | {r['peak_rss_mb']:,.0f} | {r['steps_peak_mb']:,.0f} | {r['saved_mb']:,.0f} | {sites} |")
    if os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        lines += ["", f"Run with glibc's mmap threshold fixed: MALLOC_MMAP_THRESHOLD_={os.environ['MALLOC_MMAP_THRESHOLD_']}."]
    run.write_result("training", "qlora_memory", a.tag, "\n".join(lines), {"rows": rows, "settings": vars(a)})
    print("\n".join(lines))


if __name__ == "__main__":
    main()
