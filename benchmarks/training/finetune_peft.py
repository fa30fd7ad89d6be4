"""Fine-tuning steps, tformer against transformers + PEFT, on the same chat batches: LoRA (q and v,
the same rank and alpha) and full fine-tuning, AdamW (PyTorch's fused kernel, the same lr, no weight
decay), gradient clipping at 1.0, fp32 or bf16 autocast.

The batches are the built-in chat numbers task's (``tformer finetune`` with no ``--data``): step s's
batch is :meth:`FinetuneTask.batch` (s), right-padded, targets ``-100`` on the prompt and padding
(about a fifth of the tokens are answers). tformer runs its own trainer step
(:meth:`tformer.training.loop.Loop._train_step` on :class:`FinetuneTask`: the loss on labelled
positions only, its LoRA layer, its optimizer); transformers + PEFT runs the loop its documentation
shows: ``model(input_ids).logits``, cross-entropy with ``ignore_index=-100``, backward, clip, step.

Speed: one process per method holds both models and alternates their steps (tformer, PEFT, then PEFT,
tformer, ...), each on step i's batch, so a change in the machine's load (it is shared) hits both
alike; tokens/s is the padded tokens ``B · T`` of a step over its time, the median over ``--steps``
steps after ``--warmup`` untimed ones, and the ratio is the median of the per-step-pair ratios. Memory
and losses: each (implementation, method) then runs alone in its own process (``--warmup`` + ``--steps``
steps) for its peak memory (the child's max RSS from ``os.wait4``) and the loss of its first and last step
(the first agrees on both sides: the same model, the same tokens).

    PYTHONPATH=src python benchmarks/training/finetune_peft.py --model HF_DIR [--dtype fp32|bf16] [--methods lora,full]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # benchmarks/, for common/
from common.record import Run  # noqa: E402

LR = 1e-4


def settings(a):
    from tformer.training.finetune import FinetuneSettings
    return FinetuneSettings(model=a.model, out_dir=None, method=a.method, lora_r=a.rank, lora_alpha=2 * a.rank,
                            batch_size=a.batch, n_train=a.n_train, n_test=8, eval_exact=0, lr=LR, warmup_steps=0,
                            weight_decay=0.0, grad_clip=1.0, precision=a.dtype, threads=a.threads, progress=False,
                            share_prefix=not a.no_share_prefix)


def task_and_base(a):
    from tformer.training.finetune import load_base, load_examples
    from tformer.training.tasks.finetune import FinetuneTask
    from tformer.models.decoder import DecoderLM
    s = settings(a)
    model, tok, template, stops = load_base(a.model)
    train, val, _ = load_examples(s, tok, template, stops)
    return s, model, FinetuneTask(train, [], s, tok, stops[0], labelled_only=isinstance(model, DecoderLM),
                                  share_prefix=s.share_prefix)


def tformer_steps(a, s, model, task):
    from tformer.training.lora import add_lora
    from tformer.training.loop import Loop
    torch.manual_seed(0)
    if a.method == "lora":
        add_lora(model, s.lora_spec())
    loop = Loop(model.train(), task, s)

    def step(i: int) -> float:
        loop.step = i
        return loop._train_step(LR)
    return step, [p for p in model.parameters() if p.requires_grad]


def peft_steps(a, s, task):
    import transformers
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).train()
    if a.method == "lora":
        import peft
        model = peft.get_peft_model(model, peft.LoraConfig(r=a.rank, lora_alpha=2 * a.rank, lora_dropout=0.0,
                                                           target_modules=["q_proj", "v_proj"]))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0, fused=True)

    def step(i: int) -> float:
        b = task.batch(i)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.dtype == "bf16"):
            logits = model(input_ids=b["ids"]).logits                      # (B, T, vocab)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), b["targets"].flatten(), ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())
    return step, params


def build(a, impl: str):
    s, model, task = task_and_base(a)
    if impl == "tformer":
        return tformer_steps(a, s, model, task), task
    del model
    return peft_steps(a, s, task), task


def worker(a) -> dict:
    """One implementation alone: its losses and (read by the parent) its peak memory."""
    torch.set_num_threads(a.threads)
    (step, params), task = build(a, a.impl)
    losses = [step(i) for i in range(a.warmup + a.steps)]
    return {"first_loss": losses[0], "last_loss": losses[-1], "trainable": sum(p.numel() for p in params)}


def pair(a) -> dict:
    """Both implementations in one process, their steps alternated: per-step times."""
    torch.set_num_threads(a.threads)
    (t_step, _), task = build(a, "tformer")
    (p_step, _), _ = build(a, "peft")
    times = {"tformer": [], "peft": []}
    for i in range(a.warmup + a.steps):
        for impl in (("tformer", "peft") if i % 2 == 0 else ("peft", "tformer")):
            t0 = time.perf_counter()
            (t_step if impl == "tformer" else p_step)(i)
            if i >= a.warmup:
                times[impl].append(time.perf_counter() - t0)
    tokens = [task.batch(i)["ids"].numel() for i in range(a.warmup, a.warmup + a.steps)]
    labelled = sum(int((task.batch(i)["targets"] != -100).sum()) for i in range(a.warmup, a.warmup + a.steps))
    from tformer.training.shared_prefix import positions_run, shared_prefix_length
    prefixes = [shared_prefix_length(task.batch(i)["ids"], task.batch(i)["targets"]) if task.share_prefix else 0
                for i in range(a.warmup, a.warmup + a.steps)]
    run_positions = sum(positions_run(a.batch, n // a.batch, P) for P, n in zip(prefixes, tokens))
    return {"times": times, "tokens": tokens, "labelled_share": labelled / sum(tokens),
            "shared_prefix": prefixes, "positions_run_share": run_positions / sum(tokens)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a HuggingFace Llama-family folder")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--n-train", type=int, default=200, help="examples of the built-in task to draw batches from")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--methods", default="lora,full")
    p.add_argument("--no-share-prefix", action="store_true",
                   help="tformer runs every row's full length (no shared-prefix pass), as the reference does")
    p.add_argument("--tag", default="")
    p.add_argument("--worker", nargs=2, metavar=("IMPL", "METHOD"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        a.impl, a.method = a.worker
        print(json.dumps(pair(a) if a.impl == "pair" else worker(a)))
        return
    from tformer.machine import bf16_supported, cpu_info
    name = f"finetune_peft-{a.dtype}"
    run = Run()
    if a.dtype == "bf16" and not bf16_supported("cpu"):
        run.finish()
        run.write_result("training", name, a.tag,
                         f"# Fine-tuning steps (bf16)\n\nSkipped: {cpu_info()} has no native bf16 (AVX-512-BF16 or AMX); "
                         f"bf16 autocast would be emulated and say nothing about either implementation.")
        return
    rows, pairs = [], {}

    def child(impl: str, method: str) -> tuple[dict, float]:
        argv = [sys.executable, __file__, "--worker", impl, method] + \
               [x for k in ("model", "steps", "warmup", "batch", "n_train", "rank", "threads", "dtype")
                for x in (f"--{k.replace('_', '-')}", str(getattr(a, k)))] + ["--no-share-prefix"] * a.no_share_prefix
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, env={**os.environ})
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        if status != 0:
            raise SystemExit(f"the {impl} {method} worker failed (status {status})")
        return json.loads(out.decode().splitlines()[-1]), usage.ru_maxrss / 1024

    for method in a.methods.split(","):
        pairs[method], _ = child("pair", method)
        print(method, pairs[method], flush=True)
        for impl in ("tformer", "peft"):
            res, rss = child(impl, method)
            rows.append({"method": method, "impl": impl, **res, "peak_rss_mb": rss})
            print(rows[-1], flush=True)
    run.finish()
    share = next(iter(pairs.values()))["labelled_share"]
    lines = [f"# Fine-tuning steps: tformer vs transformers + PEFT ({a.dtype})", "",
             f"{a.model}; the built-in chat numbers task, batches of {a.batch} examples right-padded "
             f"({share:.0%} of the tokens labelled); LoRA r={a.rank} alpha={2 * a.rank} on q_proj, v_proj; "
             f"fused AdamW lr {LR:g}, clip 1.0; {a.threads} threads. Speed: both in one process, steps alternated, "
             f"{a.warmup} untimed + {a.steps} timed steps each, medians; memory and losses: each alone in its own "
             f"process ({a.warmup + a.steps} steps).", "",
             (f"tformer runs the tokens all rows of a batch begin with once (`share_prefix`, "
              f"{statistics.median(next(iter(pairs.values()))['shared_prefix']):.0f} tokens, the median over the timed "
              f"batches): {next(iter(pairs.values()))['positions_run_share']:.0%} of the B·T positions the reference runs; "
              f"tokens/s counts B·T for both." if not a.no_share_prefix else
              "tformer runs every row's full length, as the reference does (`--no-share-prefix`)."), "",
             "| method | implementation | tokens/s (median) | s/step (median) | s/step (best) | peak RSS MB | first loss | last loss | trained |",
             "|---|---|---|---|---|---|---|---|---|"]
    for method in a.methods.split(","):
        pr = pairs[method]
        for impl in ("tformer", "peft"):
            r = next(x for x in rows if x["method"] == method and x["impl"] == impl)
            tps = statistics.median(n / t for n, t in zip(pr["tokens"], pr["times"][impl]))
            label = impl if impl == "tformer" else "transformers + PEFT" if method == "lora" else "transformers"
            lines.append(f"| {method} | {label} | {tps:,.0f} | {statistics.median(pr['times'][impl]):.2f} "
                         f"| {min(pr['times'][impl]):.2f} | {r['peak_rss_mb']:,.0f} | {r['first_loss']:.4f} | {r['last_loss']:.4f} | {r['trainable']:,} |")
        ratio = statistics.median(p / t for t, p in zip(pr["times"]["tformer"], pr["times"]["peft"]))
        mem = [next(x for x in rows if x["method"] == method and x["impl"] == i)["peak_rss_mb"] for i in ("tformer", "peft")]
        best = min(pr["times"]["peft"]) / min(pr["times"]["tformer"])
        lines.append(f"| {method} | **speed ratio tformer / reference** | **{ratio:.2f}×** (median of per-step pairs) | "
                     f"| **{best:.2f}×** (best steps) | **{mem[0] / mem[1]:.2f}×** (memory) | | | |")
    run.write_result("training", name, a.tag, "\n".join(lines), {"rows": rows, "pairs": pairs, "settings": vars(a)})
    print("\n".join(lines))


if __name__ == "__main__":
    main()
