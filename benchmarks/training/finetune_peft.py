"""Fine-tuning steps, tformer against transformers + PEFT, on the same batches: LoRA (q and v, the
same rank and alpha) and full fine-tuning, AdamW with the same lr, fp32 or bf16 autocast.

Each (implementation, method) runs in its own process, alternated ABAB over ``--rounds``, so the peak
memory (the child's max RSS from ``os.wait4``) is its own and a slow phase of the machine hits both.
A worker loads the HF folder (tformer through ``load_hf``), takes ``--warmup`` untimed steps, then
``--steps`` timed ones on batches drawn from one seeded generator (identical for both), and reports
tokens/s (``batch · seq`` tokens per step) and the loss of its first and last step (the two agree at
the first step: the same model, the same tokens).

    PYTHONPATH=src python benchmarks/training/finetune_peft.py --model HF_DIR [--steps 10] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # benchmarks/, for common/
from common.record import Run, results_dir  # noqa: E402


def batches(vocab: int, n: int, batch: int, seq: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (batch, seq + 1), generator=g) for _ in range(n)]


def build(impl: str, method: str, folder: str, rank: int):
    if impl == "tformer":
        from tformer.interop.hf import load_hf
        from tformer.training.lora import LoRASpec, add_lora
        model = load_hf(folder).train()
        if method == "lora":
            add_lora(model, LoRASpec(r=rank, alpha=2 * rank))
        return model, lambda x: model(x)[0]
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).train()
    if method == "lora":
        import peft
        model = peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                                           target_modules=["q_proj", "v_proj"]))
    return model, lambda x: model(input_ids=x).logits


def worker(a) -> dict:
    torch.set_num_threads(a.threads)
    model, logits_of = build(a.impl, a.method, a.model, a.rank)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0, foreach=True)
    vocab = json.loads((Path(a.model) / "config.json").read_text())["vocab_size"]
    data = batches(vocab, a.warmup + a.steps, a.batch, a.seq)
    losses, t0 = [], 0.0
    for i, b in enumerate(data):
        if i == a.warmup:
            t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.dtype == "bf16"):
            logits = logits_of(b[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), b[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    dt = time.perf_counter() - t0
    return {"tokens_per_s": a.steps * a.batch * a.seq / dt, "s_per_step": dt / a.steps, "first_loss": losses[0],
            "last_loss": losses[-1], "trainable": sum(p.numel() for p in params)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a HuggingFace Llama-family folder")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
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
    run = Run()
    rows = []
    for method in a.methods.split(","):
        for r in range(a.rounds):
            for impl in (("tformer", "peft") if r % 2 == 0 else ("peft", "tformer")):
                argv = [sys.executable, __file__, "--worker", impl, method] + \
                       [x for k in ("model", "steps", "warmup", "batch", "seq", "rank", "threads", "dtype")
                        for x in (f"--{k}", str(getattr(a, k)))]
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
             f"{a.model}; batch {a.batch} × {a.seq} tokens, LoRA r={a.rank} alpha={2 * a.rank} on q_proj, v_proj; "
             f"AdamW lr 1e-4; {a.warmup} untimed + {a.steps} timed steps per process, {a.rounds} alternated rounds.", "",
             "| method | implementation | tokens/s (best of rounds) | peak RSS MB (max) | first loss | last loss | trained |",
             "|---|---|---|---|---|---|---|"]
    summary = {}
    for method in a.methods.split(","):
        for impl in ("tformer", "peft"):
            rs = [x for x in rows if x["method"] == method and x["impl"] == impl]
            best = max(x["tokens_per_s"] for x in rs)
            summary[(method, impl)] = best
            lines.append(f"| {method} | {'transformers + PEFT' if impl == 'peft' and method == 'lora' else impl if impl == 'tformer' else 'transformers'} "
                         f"| {best:,.0f} | {max(x['peak_rss_mb'] for x in rs):,.0f} | {rs[0]['first_loss']:.4f} | "
                         f"{rs[0]['last_loss']:.4f} | {rs[0]['trainable']:,} |")
        lines.append(f"| {method} | **ratio tformer / reference** | **{summary[(method, 'tformer')] / summary[(method, 'peft')]:.2f}×** | | | | |")
    name = f"finetune_peft-{a.dtype}" + (f"-{a.tag}" if a.tag else "")
    out = results_dir("training")
    run.write(out / f"{name}.md", "\n".join(lines))
    run.write_json(out / f"{name}.json", {"rows": rows, "settings": vars(a)})
    print("\n".join(lines))


if __name__ == "__main__":
    main()
