"""``tformer finetune``: adapt a pretrained model (LoRA or full) to chat or text data."""

from __future__ import annotations

import argparse
import json
import sys

EPILOG = """settings (--set KEY=VALUE; tformer.training.finetune.FinetuneSettings): the loop's (lr, min_lr,
warmup_steps, max_steps, batch_size, grad_accum, weight_decay, precision, eval_interval, log_interval,
time_limit, seed, device, threads, checkpointing (activation checkpointing per block), trim_heap (with
checkpointing: the heap's free pages handed back before each block; lower peak RSS), ...) and lora_r,
lora_alpha, lora_dropout, lora_targets (q_proj,v_proj by default; comma-separated HF names or 'all'), qlora
(a GGUF file's blocks as the frozen base; true by default), max_length, val_fraction, eval_exact, merge,
and for the built-in task n_train, n_test, max_number; preference tuning: objective=dpo, dpo_loss (sigmoid, robust,
ipo, simpo), dpo_beta, label_smoothing, simpo_gamma.

data: a .jsonl file of {"messages": [{"role": ..., "content": ...}, ...]} lines (rendered with the model's
chat template, ChatML if it has none; the loss on the assistant's tokens only), or a plain-text file
(every token). Without --data: the built-in task "Write 4372 in French words." -> "quatre mille trois
cent soixante-douze", with held-out exact match at each evaluation. With objective=dpo: a .jsonl of
{"prompt": ..., "chosen": ..., "rejected": ...} lines (strings or message lists), or {"chosen": [messages],
"rejected": [messages]}; without --data the built-in preference task (the French words preferred to the
English words or to another number's French words), with held-out preference accuracy at each evaluation.

examples:
  tformer finetune --model smollm2-ckpt --out runs/fr                  # LoRA on the built-in task
  tformer finetune --model smollm2 --out runs/q --merge                # QLoRA over the Q4_1 file's blocks
  tformer finetune --model smollm2 --out runs/q --set checkpointing=true --set trim_heap=true   # QLoRA, least memory
  tformer finetune --model hf-folder --data chats.jsonl --method full --set max_steps=500
  tformer finetune --resume --out runs/fr --set max_steps=400          # continue a run exactly
  tformer finetune --model smollm2-ckpt --set objective=dpo --set dpo_beta=0.1 --out runs/dpo   # DPO, built-in pairs
  python -c "import peft"  # runs/fr/adapter loads with peft.PeftModel.from_pretrained(hf_model, 'runs/fr/adapter')
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "finetune", help="fine-tune a pretrained model (LoRA or full) on chat or text data",
        description="Fine-tune a tformer checkpoint or a HuggingFace folder with LoRA adapters (PEFT's format) or "
                    "every weight, on the training loop of tformer train: checkpoints, exact --resume, Ctrl-C / "
                    "SIGTERM save, progress and metrics.jsonl in --out.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", metavar="DIR", help="base model: a tformer checkpoint or a HuggingFace folder")
    p.add_argument("--data", metavar="FILE", help="chat .jsonl or plain text (default: the built-in numbers task)")
    p.add_argument("--method", choices=["lora", "full"], default=None, help="LoRA adapters (default) or every weight")
    p.add_argument("--out", metavar="DIR", help="run folder (default: runs/finetune)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    p.add_argument("--merge", action="store_true", help="also write --out/merged, the adapters folded in")
    p.add_argument("--set", metavar="KEY=VALUE", action="append", default=[], dest="settings",
                   help="override one setting; repeatable (see below)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tformer.commands.train import parse_settings
    from tformer.exits import INTERRUPTED, stopped_exit
    from tformer.training.finetune import FinetuneSettings, finish, prepare
    from tformer.training.tasks.finetune import answers

    settings = parse_settings(args.settings)
    for key, value in (("model", args.model), ("data", args.data), ("method", args.method), ("out_dir", args.out)):
        if value is not None:
            settings[key] = value
    if args.merge:
        settings["merge"] = "true"
    s = FinetuneSettings.from_strings(settings)
    loop = prepare(s, log=lambda m: print(m, flush=True), resume=args.resume, given=set(settings))
    try:
        summary = loop.fit()
    except KeyboardInterrupt:  # a second Ctrl-C: abort without saving this step
        print(f"\naborted; the last complete checkpoint (step {loop.saved_step}) is kept.", file=sys.stderr)
        return INTERRUPTED
    if (code := stopped_exit(summary["stopped"])) is not None:
        return code
    written = finish(loop)
    records = [json.loads(line) for line in (loop.out_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
               if line.strip()]                             # the whole run's, across resumes
    last = [r for r in records if "val_loss" in r or "exact_match" in r]
    first = last[0] if last else {}
    shown = ", ".join(f"{k.replace('_', ' ')} {first.get(k, float('nan')):.4f} -> {last[-1][k]:.4f}"
                      for k in ("val_loss", "exact_match", "pref_accuracy") if last and k in last[-1])
    print(f"\nfine-tuned {summary['step']} steps ({loop.elapsed:.0f} s); {shown}; "
          + "; ".join(f"{k} in {v}" for k, v in written.items()), flush=True)
    if loop.task.questions:
        prompts = loop.task.questions[:3]
        got = answers(loop.model.eval(), [p for p, _ in prompts], loop.task.stop_ids, loop.task.decode,
                      loop.task.pad_id, loop.device)
        for (_, ref), g in zip(prompts, got):
            print(f"  {g!r} (reference {ref!r})")
    return 0
