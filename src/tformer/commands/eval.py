"""``tformer eval``: score a model on lm-evaluation-harness tasks with tformer's own model class.

    tformer eval                                        # SmolLM2 on tformer_arith (50 questions written here)
    tformer eval --model FILE.gguf --tasks hellaswag --limit 100 --batch-size 8
    tformer eval --model runs/x --include my_tasks/ --tasks my_task --output results.json

The model is opened by :func:`tformer.inference.open_model` (any built-in name, GGUF file, checkpoint
or HuggingFace folder) and scored by :class:`tformer.evaluation.harness.TformerLM`; lm-eval is an
optional extra (``pip install 'tformer[eval]'``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

TASKS = Path(__file__).resolve().parents[1] / "evaluation" / "tasks"     # tformer's own tasks


def add_parser(sub: argparse._SubParsersAction) -> None:
    from tformer.inference import AUTO
    from tformer.quant.quantize import WEIGHT_FORMATS

    p = sub.add_parser("eval", help="score a model on lm-evaluation-harness tasks (default: tformer_arith)",
                       description="Run lm-evaluation-harness tasks on --model with tformer's own model class "
                                   "(loglikelihood, rolling loglikelihood and greedy generation, batched).")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--model", default=None, metavar="NAME|FILE|DIR",
                       help="smollm2 (the default), a .gguf file, a checkpoint or a HuggingFace folder")
    which.add_argument("--ckpt", default=None, metavar="DIR", help="a tformer checkpoint or run folder")
    p.add_argument("--tasks", default="tformer_arith",
                   help="comma-separated lm-eval task names (default: tformer_arith, 50 arithmetic questions)")
    p.add_argument("--include", default=None, metavar="DIR", help="a folder of task YAML files to add")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="only the first N documents of each task")
    p.add_argument("--batch-size", type=int, default=16, metavar="B", help="requests per forward (default 16)")
    p.add_argument("--num-fewshot", type=int, default=None, metavar="K", help="few-shot examples (default: the task's)")
    p.add_argument("--dtype", default=AUTO, choices=[AUTO, *WEIGHT_FORMATS],
                   help="weights (default: auto: a GGUF's own block format; float32 otherwise)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--output", default=None, metavar="FILE",
                   help="write the results, with every document's scores, to this JSON file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tformer.errors import ConfigError, InputError

    if args.batch_size < 1 or (args.limit is not None and args.limit < 1):
        raise InputError(f"--batch-size {args.batch_size} and --limit {args.limit} must be >= 1.")
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
        from lm_eval.utils import make_table
    except ImportError:
        raise ConfigError("`tformer eval` needs lm-evaluation-harness: pip install 'tformer[eval]'.") from None
    from tformer.evaluation.harness import TformerLM
    from tformer.inference import open_model, require_decoder, require_tokenizer

    include = [str(TASKS)] + ([args.include] if args.include else [])
    manager = TaskManager(include_path=include)
    names = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = [t for t in names if t not in manager.all_tasks]
    if not names or unknown:
        raise InputError(f"--tasks {args.tasks}: no task named {', '.join(unknown) or '(none given)'}; name lm-eval "
                         f"tasks (e.g. tformer_arith, hellaswag) or add a folder of YAML files with --include.")
    opened = open_model(args.ckpt or args.model, args.dtype, args.threads)
    require_decoder(opened.model, opened.source)
    require_tokenizer(opened)
    lm = TformerLM(opened, batch_size=args.batch_size)
    start = time.perf_counter()
    results = lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=manager, limit=args.limit,
                                      num_fewshot=args.num_fewshot, log_samples=args.output is not None)
    seconds = time.perf_counter() - start
    print(make_table(results))
    n = sum(len(v) for v in results.get("samples", {}).values()) if args.output else None
    print(f"{opened.name} ({opened.dtype}): evaluated in {seconds:.1f} s", file=sys.stderr)
    if args.output:
        from tformer.io import atomic_write_json

        atomic_write_json(args.output, {"model": opened.name, "dtype": opened.dtype, "seconds": seconds,
                                        "documents": n, "results": results["results"],
                                        "samples": {task: [{"doc_id": s["doc_id"], "target": s["target"],
                                                            "loglikelihoods": [r[0] for r in s["filtered_resps"]],
                                                            "acc": s.get("acc")} for s in samples]
                                                    for task, samples in results["samples"].items()}})
    return 0
