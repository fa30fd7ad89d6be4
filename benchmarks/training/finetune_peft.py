"""Fine-tuning steps, tformer against transformers + PEFT, on the same chat batches: LoRA (q and v,
the same rank and alpha) and full fine-tuning, AdamW (PyTorch's fused kernel, the same lr, no weight
decay), gradient clipping at 1.0, fp32 or bf16 autocast.

The batches are the built-in chat numbers task's (``tformer finetune`` with no ``--data``): step s's
batch is :meth:`FinetuneTask.batch` (s), right-padded, targets ``-100`` on the prompt and padding
(about a fifth of the tokens are answers). tformer runs its own trainer step
(:meth:`tformer.training.loop.Loop._train_step` on :class:`FinetuneTask`: the loss on labelled
positions only, its LoRA layer, its optimizer); transformers + PEFT runs the loop its documentation
shows: ``model(input_ids).logits``, cross-entropy with ``ignore_index=-100``, backward, clip, step.

Each (implementation, method) runs in its own process, alternated (ABAB, then BABA) over
``--rounds``, so the peak memory (the child's max RSS from ``os.wait4``) is its own and a slow phase
of the machine hits both. A worker loads the HF folder (tformer through ``load_hf``), takes
``--warmup`` untimed steps, then ``--steps`` timed ones, and reports tokens/s (padded tokens
``B · T`` of the batches per second, the same batches on both sides) and the loss of its first and
last step. The table gives medians over rounds and their ratio.

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
from common.record import Run, results_dir  # noqa: E402

LR = 1e-4


def settings(a):
    from tformer.training.finetune import FinetuneSettings
    return FinetuneSettings(model=a.model, out_dir=None, method=a.method, lora_r=a.rank, lora_alpha=2 * a.rank,
                            batch_size=a.batch, n_train=a.n_train, n_test=8, eval_exact=0, lr=LR, warmup_steps=0,
                            weight_decay=0.0, grad_clip=1.0, precision=a.dtype, threads=a.threads, progress=False)


def task_and_base(a):
    from tformer.training.finetune import load_base, load_examples
    from tformer.training.tasks.finetune import FinetuneTask
    from tformer.models.decoder import DecoderLM
    s = settings(a)
    model, tok, template, stops = load_base(a.model)
    train, val, _ = load_examples(s, tok, template, stops)
    return s, model, FinetuneTask(train, [], s, tok, stops[0], labelled_only=isinstance(model, DecoderLM))


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


def worker(a) -> dict:
    torch.set_num_threads(a.threads)
    s, model, task = task_and_base(a)
    if a.impl == "tformer":
        step, params = tformer_steps(a, s, model, task)
    else:
        del model
        step, params = peft_steps(a, s, task)
    losses, t0 = [], 0.0
    tokens = sum(task.batch(i)["ids"].numel() for i in range(a.warmup, a.warmup + a.steps))
    labelled = sum(int((task.batch(i)["targets"] != -100).sum()) for i in range(a.warmup, a.warmup + a.steps))
    for i in range(a.warmup + a.steps):
        if i == a.warmup:
            t0 = time.perf_counter()
        losses.append(step(i))
    dt = time.perf_counter() - t0
    return {"tokens_per_s": tokens / dt, "s_per_step": dt / a.steps, "labelled_share": labelled / tokens,
            "first_loss": losses[0], "last_loss": losses[-1], "trainable": sum(p.numel() for p in params)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a HuggingFace Llama-family folder")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--n-train", type=int, default=200, help="examples of the built-in task to draw batches from")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--methods", default="lora,full")
    p.add_argument("--tag", default="")
    p.add_argument("--worker", nargs=2, metavar=("IMPL", "METHOD"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        a.impl, a.method = a.worker
        print(json.dumps(worker(a)))
        return
    from tformer.machine import bf16_supported, cpu_info
    name = f"finetune_peft-{a.dtype}" + (f"-{a.tag}" if a.tag else "")
    run = Run()
    if a.dtype == "bf16" and not bf16_supported("cpu"):
        run.finish()
        run.write(results_dir("training") / f"{name}.md",
                  f"# Fine-tuning steps (bf16)\n\nSkipped: {cpu_info()} has no native bf16 (AVX-512-BF16 or AMX); "
                  f"bf16 autocast would be emulated and say nothing about either implementation.")
        return
    rows = []
    for method in a.methods.split(","):
        for r in range(a.rounds):
            for impl in (("tformer", "peft") if r % 2 == 0 else ("peft", "tformer")):
                argv = [sys.executable, __file__, "--worker", impl, method] + \
                       [x for k in ("model", "steps", "warmup", "batch", "n_train", "rank", "threads", "dtype")
                        for x in (f"--{k.replace('_', '-')}", str(getattr(a, k)))]
                proc = subprocess.Popen(argv, stdout=subprocess.PIPE, env={**os.environ})
                out = proc.stdout.read()
                _, status, usage = os.wait4(proc.pid, 0)
                if status != 0:
                    raise SystemExit(f"the {impl} {method} worker failed (status {status})")
                rows.append({"method": method, "impl": impl, "round": r, **json.loads(out.decode().splitlines()[-1]),
                             "peak_rss_mb": usage.ru_maxrss / 1024})
                print(rows[-1], flush=True)
    run.finish()
    lines = [f"# Fine-tuning steps: tformer vs transformers + PEFT ({a.dtype})", "",
             f"{a.model}; the built-in chat numbers task, batches of {a.batch} examples right-padded "
             f"({rows[0]['labelled_share']:.0%} of the tokens labelled); LoRA r={a.rank} alpha={2 * a.rank} on "
             f"q_proj, v_proj; fused AdamW lr {LR:g}, clip 1.0; {a.warmup} untimed + {a.steps} timed steps per "
             f"process, {a.rounds} alternated rounds; medians over rounds.", "",
             "| method | implementation | tokens/s (median) | s/step | peak RSS MB (max) | first loss | last loss | trained |",
             "|---|---|---|---|---|---|---|---|"]
    summary = {}
    for method in a.methods.split(","):
        for impl in ("tformer", "peft"):
            rs = [x for x in rows if x["method"] == method and x["impl"] == impl]
            med = statistics.median(x["tokens_per_s"] for x in rs)
            summary[(method, impl)] = (med, max(x["peak_rss_mb"] for x in rs))
            label = impl if impl == "tformer" else "transformers + PEFT" if method == "lora" else "transformers"
            lines.append(f"| {method} | {label} | {med:,.0f} | {statistics.median(x['s_per_step'] for x in rs):.2f} "
                         f"| {summary[(method, impl)][1]:,.0f} | {rs[0]['first_loss']:.4f} | {rs[0]['last_loss']:.4f} "
                         f"| {rs[0]['trainable']:,} |")
        (t, mt), (h, mh) = summary[(method, "tformer")], summary[(method, "peft")]
        lines.append(f"| {method} | **ratio tformer / reference** | **{t / h:.2f}×** | | **{mt / mh:.2f}×** | | | |")
    out = results_dir("training")
    run.write(out / f"{name}.md", "\n".join(lines))
    run.write_json(out / f"{name}.json", {"rows": rows, "settings": vars(a)})
    print("\n".join(lines))


if __name__ == "__main__":
    main()
