"""``tformer train``: train a language model on a text corpus (default: Python's own standard library)."""

from __future__ import annotations

import argparse
import sys

from tformer.config import PRESETS
from tformer.errors import ConfigError
from tformer.exits import INTERRUPTED, stopped_exit
from tformer.training.config import MODEL_KEYS

TRAIN_HELP = {
    "data": "corpus file, folder or glob (same as --data; none = built-in stdlib corpus)",
    "out_dir": "run folder (same as --out)",
    "tokenizer": "char or bpe (byte-level BPE trained on the corpus)",
    "bpe_vocab_size": "BPE vocabulary size (>= 256)",
    "val_fraction": "share of the corpus (its tail) kept for validation",
    "cache_dir": "tokenised-corpus cache (none = ~/.cache/tformer)",
    "batch_size": "sequences per micro-batch",
    "grad_accum": "micro-batches per optimizer step",
    "max_steps": "optimizer steps of the run",
    "decay_steps": "step where the cosine reaches min_lr (0 = max_steps)",
    "lr": "peak learning rate", "min_lr": "final learning rate", "warmup_steps": "linear warmup steps",
    "weight_decay": "AdamW weight decay (matrices only)", "beta1": "AdamW beta1", "beta2": "AdamW beta2",
    "grad_clip": "gradient-norm clipping (0 = off)",
    "precision": "auto, bf16 (autocast) or fp32",
    "compile": "torch.compile the model (true/false)",
    "checkpointing": "activation checkpointing per block: less memory, one more forward (true/false)",
    "threads": "torch threads (0 = the cores the load average leaves free)",
    "device": "auto, cpu or cuda", "seed": "init, batch order and sampling seed",
    "eval_interval": "evaluate, sample and save every N steps",
    "eval_batches": "batches per split at each evaluation",
    "log_interval": "progress bar / metrics.jsonl every N steps",
    "sample_tokens": "tokens sampled at each evaluation (0 = none)",
    "sample_prompt": "prompt of those samples",
    "time_limit": "stop and save after this many seconds (0 = none)",
    "max_hours": "refuse a run that would take longer here, at least (its FLOPs at the measured peak; 0 = no limit)",
    "progress": "show the progress bar (true/false)",
    "encoding": "text encoding of the corpus files (undecodable bytes become U+FFFD and are counted)",
    "strategy": "with several ranks: ddp (replicas) or fsdp (sharded parameters and optimizer state)",
    "dist_timeout": "seconds a rank waits for the others in a collective before failing",
}


def _epilog() -> str:
    import dataclasses

    from tformer.config import PRESETS, TransformerConfig
    from tformer.training.config import TrainConfig

    train = "\n".join(f"  {f.name:<15} {TRAIN_HELP.get(f.name, '')} (default: {f.default!r})"
                      for f in dataclasses.fields(TrainConfig))
    tiny = TransformerConfig.from_name("tiny")
    model = ", ".join(f"{k}={getattr(tiny, k)!r}" for k in MODEL_KEYS)
    return f"""trainer settings (--set KEY=VALUE, or KEY = VALUE in --config FILE.toml):
{train}

model settings (TransformerConfig fields; values shown are the tiny preset's):
  {model}
  vocab_size always comes from the tokenizer. Presets: {', '.join(PRESETS)}.

examples:
  tformer train                                    # tiny model on the built-in corpus (stdlib source)
  tformer train --data input.txt --out runs/mine --set max_steps=5000 --set tokenizer=bpe
  tformer train --resume --out runs/mine --set max_steps=8000   # continue a run
  tformer sample --ckpt runs/mine --prompt "def "
  tformer train --nproc 2 --set strategy=fsdp --out runs/two      # 2 processes on this machine (torchrun)
  torchrun --nproc-per-node 2 -m tformer train --out runs/two      # the same, launched by hand
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train", help="train a language model on a text corpus",
        description="Train a decoder-only language model on a text file, a folder of text files or a glob "
                    "(default: the running Python's standard-library source, no download). Tokenises once into "
                    "a memory-mapped cache, trains with the recipe's optimiser and schedule (default: AdamW, warm-up / "
                    "stable / decay; recipe=classic: nanoGPT's warm-up + cosine), evaluates and samples every "
                    "eval_interval steps, writes atomic checkpoints and metrics.jsonl to --out. "
                    "Ctrl-C or SIGTERM saves a checkpoint and exits; --resume continues exactly.",
        epilog=_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", metavar="PATH", help="corpus: text file, folder or glob (default: built-in stdlib corpus)")
    p.add_argument("--preset", choices=list(PRESETS), default=None, help="model preset (default: tiny)")
    p.add_argument("--config", metavar="FILE.toml", help="TOML file of settings (optional 'preset' key; "
                                                          "keys flat or under [model]/[train])")
    p.add_argument("--set", metavar="KEY=VALUE", action="append", default=[], dest="settings",
                   help="override one setting; repeatable (see the list below)")
    p.add_argument("--out", metavar="DIR", help="run folder for checkpoints and metrics (default: runs/<preset>)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    p.add_argument("--task", choices=["lm", "seq2seq"], default="lm",
                   help="lm: language model (default); seq2seq: translate source<TAB>target pairs (--data pairs.tsv, "
                        "read with --encoding; none = built-in English->French numbers task; settings: "
                        "tformer.training.seq2seq.Seq2SeqSettings, the trainer settings above but for the "
                        "language-model ones, plus its own); both keep a run lock, checkpoints and --resume")
    p.add_argument("--encoding", default=None, help="text encoding of the corpus (default utf-8; same as "
                                                    "--set encoding=...)")
    p.add_argument("--nproc", type=int, metavar="N", default=None,
                   help="run on N processes of this machine through torchrun (see --set strategy=ddp|fsdp); "
                        "for several machines run torchrun yourself (docs/training.md)")
    p.set_defaults(func=run)


def read_toml(path: str) -> dict:
    """Settings from a TOML file: flat keys, or tables [model] / [train]; 'preset' is allowed."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        raise ConfigError("--config needs Python 3.11+ (tomllib); pass the settings with --set instead.") from None
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist; pass an existing FILE.toml to --config.") from None
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"cannot read config file {path}: {e}; fix the TOML syntax.") from None
    flat = {}
    for key, value in data.items():
        if key in ("model", "train") and isinstance(value, dict):
            flat.update(value)
        else:
            flat[key] = value
    return flat


def parse_settings(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r} is not KEY=VALUE; write e.g. --set max_steps=500.")
        out[key.strip()] = value
    return out


def _launch_args(args: argparse.Namespace) -> list[str]:
    """The ``tformer train`` arguments to hand on to each rank (all but --nproc)."""
    out = []
    for flag, value in (("--data", args.data), ("--preset", args.preset), ("--config", args.config),
                        ("--out", args.out), ("--encoding", args.encoding)):
        out += [flag, value] if value is not None else []
    for item in args.settings:
        out += ["--set", item]
    return out + (["--resume"] if args.resume else [])


def run(args: argparse.Namespace) -> int:
    from tformer.training import distributed
    if args.nproc is not None and args.task == "seq2seq":
        raise ConfigError("--task seq2seq trains in one process; drop --nproc.")
    if args.nproc is not None:
        from tformer.training import launcher
        if distributed.under_torchrun():
            raise ConfigError("--nproc starts torchrun itself; under torchrun drop --nproc "
                              "(torchrun's --nproc-per-node sets the number of ranks).")
        preset, settings = _settings(args)
        launcher.check_ranks(args.nproc, settings, preset, args.resume)   # once, before any rank starts
        return launcher.launch(args.nproc, _launch_args(args))
    try:
        return _train(args)
    finally:
        distributed.shutdown()


def _settings(args: argparse.Namespace) -> tuple[str | None, dict]:
    """``(preset, settings)`` of a run: the TOML file's, then --set, then the flags."""
    settings = read_toml(args.config) if args.config else {}
    preset = args.preset or settings.pop("preset", None)
    settings.pop("preset", None)
    settings.update(parse_settings(args.settings))
    if args.data is not None:
        settings["data"] = args.data
    if args.out is not None:
        settings["out_dir"] = args.out
    if args.encoding is not None:
        settings["encoding"] = args.encoding
    return preset, settings


def _train(args: argparse.Namespace) -> int:
    from tformer.training.trainer import Trainer

    if getattr(args, "task", "lm") == "seq2seq":
        return _train_seq2seq(args)
    preset, settings = _settings(args)
    try:
        trainer = Trainer.create(settings, preset=preset, resume=args.resume, log=lambda m: print(m, flush=True))
    except KeyboardInterrupt:
        print("\ninterrupted before training started; nothing was saved.", file=sys.stderr)
        return INTERRUPTED
    try:
        result = trainer.fit()
    except KeyboardInterrupt:  # a second Ctrl-C: abort without saving this step
        print(f"\naborted at step {trainer.step}; the last complete checkpoint (step {trainer.saved_step}) "
              f"is kept in {trainer.out_dir}.", file=sys.stderr)
        return INTERRUPTED
    if (code := stopped_exit(result["stopped"])) is not None:
        return code
    main = trainer.dist.is_main                    # rank 0 alone prints
    sample = trainer.sample(max(trainer.cfg.sample_tokens, 300)) if trainer.cfg.sample_tokens > 0 else ""
    if not main:
        return 0
    print(f"\ntrained {result['step']} steps; best val loss {result['best_val_loss']:.4f}; "
          f"checkpoint in {result['out_dir']}", flush=True)
    if trainer.cfg.sample_tokens > 0:  # the final sample is a little longer than the ones at evaluations
        print(f"--- generated text ({max(trainer.cfg.sample_tokens, 300)} tokens) ---", flush=True)
        sys.stdout.write(sample + "\n")
    print(f"--- more: tformer sample --ckpt {result['out_dir']} --prompt \"...\" ---")
    return 0


def _train_seq2seq(args: argparse.Namespace) -> int:
    """``tformer train --task seq2seq``: a :class:`~tformer.training.seq2seq.Seq2SeqSettings` run."""
    from tformer.training.seq2seq import Seq2SeqSettings, train

    _, settings = _settings(args)
    if args.preset:
        raise ConfigError("--task seq2seq takes no --preset; set the model with --set model=... "
                          "(encoder-decoder, bahdanau, rnn-encoder-decoder) and sizes with --set d_model=... .")
    settings.pop("preset", None)                 # a TOML file's preset, or --set preset=..., is not this task's
    s = Seq2SeqSettings.from_strings(settings)
    given = {"architecture" if k in MODEL_KEYS else k for k in settings}     # on resume, these override the saved
    try:
        metrics = train(s, log=lambda m: print(m, flush=True), resume=args.resume, given=given)
    except KeyboardInterrupt:  # a second Ctrl-C: abort without saving this step
        print("\naborted; the last complete checkpoint is kept.", file=sys.stderr)
        return INTERRUPTED
    if (code := stopped_exit(metrics.get("stopped"))) is not None:
        return code
    for ex in metrics["examples"][:3]:
        print(f"  {ex['source']!r} -> {ex['output']!r} (reference {ex['reference']!r})")
    print(f"--- more: tformer translate --ckpt {s.out_dir} \"...\" --beams 4 ---")
    return 0
