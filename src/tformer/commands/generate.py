"""``tformer generate``: continue a prompt with a trained checkpoint, printing tokens/s to stderr."""

from __future__ import annotations

import argparse
import sys
import time

import torch

from tformer.errors import InputError


def add_parser(sub: argparse._SubParsersAction) -> None:
    from tformer.inference import AUTO
    from tformer.quant.quantize import WEIGHT_FORMATS

    p = sub.add_parser("generate", help="generate text from a model (KV-cached)",
                       description="Continue --prompt with the model named by --model (or --ckpt). The text goes to "
                                   "stdout; the speed (tokens/s) to stderr.")
    add_arguments(p)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable); the text is cut before it")
    p.add_argument("--stream", action="store_true", help="print the text as it is produced")
    p.add_argument("--ignore-eos", action="store_true",
                   help="do not stop at the end-of-sequence (or end-of-turn) token the model names")
    p.add_argument("--dtype", default=AUTO, choices=[AUTO, *WEIGHT_FORMATS],
                   help="weights: auto (a GGUF's own block format, e.g. q4_1 for smollm2; float32 otherwise), fp32, "
                        "bf16, fp16, int8 / int4 weight-only linears, or GGUF's q8_0 / q4_0 / q4_1 blocks with "
                        "integer kernels (a GGUF stored in that format keeps its blocks) (default: auto)")
    p.add_argument("--no-cache", action="store_true", help="recompute the whole window every token (slow)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--verbose", action="store_true", help="say which weights and path run, and why")
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser, prompt_default: str | None = None, top_k_default: int | None = None) -> None:
    """The arguments ``generate`` and ``sample`` share."""
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--ckpt", metavar="DIR",
                       help="run folder (--out of tformer train) or checkpoint folder "
                            "(tformer_config.json, model.safetensors, tokenizer.json)")
    which.add_argument("--model", metavar="NAME|FILE|DIR",
                       help="a built-in model (smollm2: SmolLM2-135M-Instruct), a .gguf file (read as it is), or a "
                            "checkpoint folder")
    p.add_argument("--prompt", required=prompt_default is None, default=prompt_default,
                   help="the text to continue" + (f" (default: {prompt_default!r})" if prompt_default else ""))
    p.add_argument("--max-new-tokens", type=int, default=200, metavar="N", help="most tokens to generate (default: 200)")
    p.add_argument("--temperature", type=float, default=None, metavar="T",
                   help="0 = greedy (default: the model file's recommendation, else 0.8)")
    p.add_argument("--top-k", type=int, default=None, metavar="K",
                   help=f"sample among the K most likely tokens (default: the file's recommendation, else "
                        f"{top_k_default or 'all'})")
    p.add_argument("--top-p", type=float, default=None,
                   help="nucleus sampling mass in (0, 1] (default: the file's recommendation, else 1)")
    p.set_defaults(fallback={"temperature": 0.8, "top_k": top_k_default, "top_p": None})
    p.add_argument("--seed", type=int, default=None, help="random seed, for reproducible sampling")
    add_penalty_arguments(p)


def add_penalty_arguments(p: argparse.ArgumentParser) -> None:
    """min-p, the penalties and logit biases: the options ``generate``, ``sample`` and ``chat`` share
    beyond temperature, top-k and top-p (:mod:`tformer.generation.penalties`)."""
    p.add_argument("--min-p", type=float, default=None, metavar="P",
                   help="keep tokens at least P times as likely as the most likely one (default: the file's "
                        "recommendation, else off)")
    p.add_argument("--repetition-penalty", type=float, default=None, metavar="R",
                   help="divide a positive logit (multiply a negative one) of every token already in the prompt or "
                        "the answer by R, e.g. 1.2 (default: the file's recommendation, else 1: off)")
    p.add_argument("--presence-penalty", type=float, default=0.0, metavar="X",
                   help="subtract X from the logit of every token already generated, in [-2, 2] (default 0)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, metavar="X",
                   help="subtract X times its count from the logit of every token generated, in [-2, 2] (default 0)")
    p.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                   help="add BIAS (in [-100, 100]) to token ID's logit; repeatable (-100 bans the token)")


# The most tokens one command generates: the output buffer (B, T + N) is allocated up front.
MAX_NEW_TOKENS = 1 << 20


def check_options(args: argparse.Namespace) -> None:
    """Every generation option's range and finiteness, before anything is loaded, naming the option
    (the checks are generation's own: :mod:`tformer.generation.sampling`, :mod:`tformer.generation.penalties`)."""
    from tformer.generation.sampling import check_max_new_tokens, check_sampling
    from tformer.machine import available_cores

    threads, cores = getattr(args, "threads", None), available_cores()
    if threads is not None and not 1 <= threads <= cores:
        raise InputError(f"--threads {threads} is out of range; pass between 1 and {cores} (the cores available).")
    check_max_new_tokens(args.max_new_tokens, MAX_NEW_TOKENS, flags=True)
    check_sampling(args.temperature, args.top_k, args.top_p, args.seed, min_p=getattr(args, "min_p", None), flags=True)
    penalties(args).check(flags=True)


def logit_bias(pairs: list[str]) -> tuple[tuple[int, float], ...]:
    """``--logit-bias ID=BIAS`` values as ``(id, bias)`` pairs; one sentence for a malformed one."""
    out = []
    for pair in pairs:
        tok, _, bias = pair.partition("=")
        try:
            out.append((int(tok), float(bias)))
        except ValueError:
            raise InputError(f"--logit-bias {pair}: write a token id and a bias, e.g. --logit-bias 2=-100.") from None
    return tuple(out)


def penalties(args: argparse.Namespace):
    """The :class:`~tformer.generation.penalties.Penalties` the command line names (unset: none)."""
    from tformer.generation.penalties import Penalties

    rep = getattr(args, "repetition_penalty", None)
    return Penalties(1.0 if rep is None else rep, getattr(args, "presence_penalty", 0.0),
                     getattr(args, "frequency_penalty", 0.0), logit_bias(getattr(args, "logit_bias", [])))


# The options a model's file may recommend (a GGUF's general.sampling.*), and their defaults when it does not.
RECOMMENDED = {"min_p": None, "repetition_penalty": None}


def sampling_options(args: argparse.Namespace, file_defaults: dict, fallback: dict) -> dict:
    """Temperature, top-k, top-p, min-p, the penalties and the seed: as given on the command line, else as the
    model's file recommends (a GGUF's ``general.sampling.*``), else the command's ``fallback``; checked (naming
    the option). Returns :class:`~tformer.generation.generate.GenerationOptions` fields."""
    fallback = {**RECOMMENDED, **fallback}
    chosen = {k: getattr(args, k, None) if getattr(args, k, None) is not None else file_defaults.get(k, fallback[k])
              for k in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")}
    checked = argparse.Namespace(**{**vars(args), **chosen})
    check_options(checked)
    p = penalties(checked)
    return {**{k: chosen[k] for k in ("temperature", "top_k", "top_p", "min_p")}, "seed": args.seed,
            "repetition_penalty": p.repetition, "presence_penalty": p.presence, "frequency_penalty": p.frequency,
            "logit_bias": p.bias}


def run(args: argparse.Namespace, echo: bool = False) -> int:
    """Generate; with ``echo`` the prompt is printed before its continuation."""
    from tformer.generation.text import generate_text, stream_text
    from tformer.inference import AUTO, open_model, require_tokenizer
    from tformer.quant.quantize import QUANT_WIDTH

    dtype, use_cache = getattr(args, "dtype", AUTO), not getattr(args, "no_cache", False)
    sampling_options(args, {}, args.fallback)        # what was given, checked before anything loads
    opened = open_model(args.model or args.ckpt, dtype, getattr(args, "threads", None))
    model, tokenizer = opened.model, opened.tokenizer
    if getattr(args, "verbose", False):
        print(opened.describe(), file=sys.stderr, flush=True)
    if opened.dtype in QUANT_WIDTH:
        say_float_linears(model, opened.dtype)
    if not getattr(model.config, "causal", False) or not hasattr(model, "lm_head"):
        raise InputError(f"{opened.source} holds a {type(model).__name__}, which does not generate text; pass the "
                         f"checkpoint of a causal language model (tformer train, or a converted GPT-2/Llama).")
    require_tokenizer(opened)
    eos = [] if getattr(args, "ignore_eos", False) else opened.stop_ids
    stats: dict = {}
    options = dict(**sampling_options(args, opened.defaults, args.fallback), stop=getattr(args, "stop", []),
                   stop_tokens=eos or None, use_cache=use_cache, stats=stats)
    start = time.perf_counter()
    if echo:
        sys.stdout.write(args.prompt)
    if getattr(args, "stream", False):
        for piece in stream_text(model, tokenizer, args.prompt, args.max_new_tokens, **options):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
    else:
        print(generate_text(model, tokenizer, args.prompt, args.max_new_tokens, **options))
    elapsed = time.perf_counter() - start
    n = stats.get("new_tokens", 0)
    print(f"{n} tokens in {elapsed:.2f} s: {n / max(elapsed, 1e-9):.1f} tokens/s "
          f"({opened.dtype}, {_state_kind(model) if use_cache else 'no cache'}, {opened.path} path, "
          f"{torch.get_num_threads()} threads)", file=sys.stderr)
    return 0


def say_float_linears(model, dtype: str) -> None:
    """One line on stderr when ``--dtype int8/int4`` left linear layers in bf16 (the kernels need
    ``in_features`` a multiple of 16 / 32): the speed and size then are not all int8/int4's."""
    from tformer.quant.quantize import QUANT_WIDTH, float_linears

    left, total = float_linears(model)
    if left:
        names = ", ".join(left[:4]) + (f", ... ({len(left) - 4} more)" if len(left) > 4 else "")
        rest = "float32" if dtype.startswith("q") else "bf16"        # the block formats keep the rest in float32
        print(f"tformer generate: note: {dtype} left {len(left)} of {total} linear layers in {rest} (their input width "
              f"is not a multiple of {QUANT_WIDTH[dtype]}): {names}", file=sys.stderr)


def _state_kind(model) -> str:
    """What the model keeps between tokens: a KV cache (attention) or a recurrent state (Mamba, hybrids)."""
    mixers = set(model.config.layer_mixers())
    return "KV cache" if mixers == {"attention"} else "inference state: " + " + ".join(sorted(mixers))
