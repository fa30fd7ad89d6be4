"""``tformer finetune``: adapt a pretrained decoder (a tformer checkpoint or a HuggingFace folder) to
chat or text data, with LoRA (:mod:`tformer.training.lora`) or every weight, on the one training
loop (:mod:`tformer.training.loop`): its checkpoints, exact resume, SIGTERM save, run lock and progress.

A run folder holds the loop's ``ckpt/step-N`` (the whole model, base and adapters, with the optimizer
state of the trained tensors only) and, at the end, ``adapter/`` (PEFT's LoRA format) and with
``merge=true`` ``merged/`` (a plain tformer checkpoint with the adapters folded in, the tokenizer
and the chat template). The chat template, the data's fingerprint and the base model are kept in
each checkpoint's trainer state, so ``--resume`` needs nothing but the run folder and the data.
"""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from tformer.checkpoint import WEIGHTS, load_config, read_pointer, save_model
from tformer.errors import CheckpointError, ConfigError, InputError
from tformer.io import atomic_write
from tformer.models import build_model
from tformer.models.decoder import DecoderLM
from tformer.tokenizers import load_tokenizer
from tformer.training import distributed
from tformer.training.chat_data import ChatTemplate, chat_example, encode, number_task, read_chat, text_examples, truncate
from tformer.training.config import TrainConfig, cast_value
from tformer.training.dpo import LOSSES, REFERENCE_FREE
from tformer.training.lora import TARGETS, LoRASpec, add_lora, lora_parameters, merge_lora, model_targets
from tformer.training.loop import Loop
from tformer.training.peft_adapter import save_adapter
from tformer.training.runlock import check_run_folder, locked_run
from tformer.training.runstate import read_latest, resumed_settings, start_metrics
from tformer.quant.block_linear import BlockLinear, use_float_tiles
from tformer.training.preference_data import preference_task, read_preferences
from tformer.training.tasks.finetune import FinetuneTask
from tformer.training.tasks.preference import PreferenceTask

METHODS = ("lora", "full")
OBJECTIVES = ("sft", "dpo")
UNUSED = ("tokenizer", "bpe_vocab_size", "cache_dir", "sample_tokens", "sample_prompt", "strategy", "max_hours")
RESUME_KEEPS = ("model", "data", "encoding", "method", "share_prefix", "lora_r", "lora_alpha", "lora_dropout",
                "lora_targets", "qlora", "objective", "dpo_loss", "dpo_beta", "label_smoothing", "simpo_gamma",
                "max_length", "val_fraction", "n_train", "n_test", "max_number", "seed")


@dataclass
class FinetuneSettings(TrainConfig):
    """Everything ``tformer finetune`` reads (``--set key=value``): the loop's optimisation, schedule,
    precision, checkpoint and time fields (defaults below) and the fine-tuning ones.

    Args:
        model: the base model, a tformer checkpoint / run folder or a HuggingFace folder.
        data: chat JSONL (``.jsonl``) or plain text; ``None`` = the built-in chat numbers task.
        method: ``lora`` (adapters, base frozen) or ``full`` (every weight).
        lora_r, lora_alpha, lora_dropout, lora_targets: LoRA's rank, scale numerator, input dropout and
            projections (comma-separated HF names, or ``all``).
        max_length: tokens an example keeps (longer ones are cut).
        val_fraction: share of the examples held out for ``val_loss``.
        n_train, n_test, max_number: the built-in task's size and largest number.
        eval_exact: held-out questions answered greedily for ``exact_match`` at each evaluation
            (the built-in task; 0 = none).
        merge: also write ``merged/``, the model with the adapters folded in (over a GGUF file's blocks also
            ``merged.gguf``: in the file's block format, Q8_0 for a 4-bit one, :data:`MERGED_FORMAT`).
        qlora: with ``method=lora`` and a GGUF file whose matrices are in one block format tformer keeps, train
            over the file's blocks as they are (QLoRA, :mod:`tformer.quant.tiled`); ``false`` widens the base
            to float32 first.
        share_prefix: run the tokens every row of a batch begins with (a default system prompt) once
            per batch (:mod:`tformer.training.shared_prefix`: the same loss and gradients up to rounding).
        objective: ``sft`` (the answers' cross-entropy) or ``dpo`` (preference pairs; ``data`` a preference
            JSONL, :mod:`tformer.training.preference_data`; without it the built-in preference task).
        dpo_loss, dpo_beta, label_smoothing, simpo_gamma: the preference loss (``sigmoid``: DPO, cDPO with
            label smoothing; ``robust``; ``ipo``; ``simpo``, reference-free), its ``β``, ``ε`` and SimPO's ``γ``
            (:mod:`tformer.training.dpo`).
    """

    model: str | None = None
    out_dir: str | None = "runs/finetune"
    method: str = "lora"
    lora_r: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: str = "q_proj,v_proj"
    max_length: int = 256
    val_fraction: float = 0.05
    n_train: int = 2000
    n_test: int = 100
    max_number: int = 9999
    eval_exact: int = 100
    merge: bool = False
    qlora: bool = True
    share_prefix: bool = True
    objective: str = "sft"
    dpo_loss: str = "sigmoid"
    dpo_beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    batch_size: int = 8
    max_steps: int = 200
    warmup_steps: int = 10
    lr: float = 2e-4
    min_lr: float = 0.0
    weight_decay: float = 0.0
    eval_interval: int = 50
    eval_batches: int = 4
    log_interval: int = 5
    seed: int = 0

    RANGES = {"lora_r": (1, None, True, True), "lora_alpha": (0.0, None, False, True),
              "lora_dropout": (0.0, 1.0, True, False), "max_length": (2, None, True, True),
              "val_fraction": (0.0, 1.0, True, False), "n_train": (1, None, True, True),
              "n_test": (1, None, True, True), "max_number": (1, None, True, True), "eval_exact": (0, None, True, True),
              "dpo_beta": (0.0, None, False, True), "label_smoothing": (0.0, 0.5, True, False),
              "simpo_gamma": (0.0, None, True, True)}

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.method not in METHODS:
            raise ConfigError(f"method={self.method!r} is not known; choose lora or full.")
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"objective={self.objective!r} is not known; choose sft or dpo.")
        if self.dpo_loss not in LOSSES:
            raise ConfigError(f"dpo_loss={self.dpo_loss!r} is not known; choose one of {', '.join(LOSSES)}.")
        if self.dpo_loss == "ipo" and self.label_smoothing:
            raise ConfigError("label_smoothing has no meaning for dpo_loss=ipo; drop it, or use sigmoid or robust.")
        self.lora_spec()

    def lora_spec(self, model: torch.nn.Module | None = None) -> LoRASpec:
        """The LoRA of these settings; ``all`` targets every projection ``model`` has (every one LoRA knows
        when no model is given: the settings' own check)."""
        if self.lora_targets.strip() == "all":
            targets = TARGETS if model is None else model_targets(model)
        else:
            targets = tuple(t.strip() for t in self.lora_targets.split(",") if t.strip())
        return LoRASpec(r=self.lora_r, alpha=self.lora_alpha, dropout=self.lora_dropout, targets=targets)

    @classmethod
    def from_strings(cls, values: dict[str, Any]) -> "FinetuneSettings":
        own = [f.name for f in dataclasses.fields(cls) if f.name not in UNUSED]
        out = {}
        for key, value in values.items():
            if key not in own:
                raise ConfigError(f"unknown setting {key!r} for tformer finetune; valid keys are: "
                                  f"{', '.join(sorted(own))}.")
            out[key] = cast_value(key, value, schema=cls)
        return cls(**out)


# ---------------------------------------------------------------------------------------- the base model
def load_base(path: str, blocks: bool = False, log: Callable[[str], None] | None = None,
              ) -> tuple[torch.nn.Module, Any, ChatTemplate, tuple[int, ...]]:
    """``(model, tokenizer, chat template, stop ids)`` of a tformer checkpoint / run folder, a HuggingFace
    folder or a GGUF file, opened by :func:`tformer.inference.open_model` with plain float modules (their
    parameters train); a GGUF file widened to float32, or with ``blocks`` (QLoRA) kept in its own blocks
    where every matrix is in one block format tformer keeps (:func:`qlora_dtype`; ``log`` is told when a
    file is widened instead), their products in float tile by tile."""
    from tformer.inference import open_model, require_tokenizer

    dtype, why = qlora_dtype(path) if blocks else ("fp32", None)
    if why and log is not None:
        log(why)
    opened = open_model(path, dtype, kernels=False)
    use_float_tiles(opened.model)                     # the blocks (if any) as a frozen base that passes gradients
    require_tokenizer(opened)                         # fine-tuning needs the base model's tokenizer
    if opened.kind == "gguf":                         # the file's own template and special tokens
        special = opened.template.special if opened.template is not None else {}
        template = ChatTemplate(opened.template.source if opened.template is not None else ChatTemplate.source,
                                special.get("bos_token", ""), special.get("eos_token", ""))
    else:
        template = read_template(opened.source)
    stops = list(opened.stop_ids)
    for special in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", template.eos_token):
        tid = token_id(opened.tokenizer, special)
        if tid is not None and tid not in stops:
            stops.append(tid)
    return opened.model, opened.tokenizer, template, tuple(stops)


def qlora_dtype(path: str) -> tuple[str, str | None]:
    """``(dtype, why widened)`` QLoRA opens ``path`` in: a GGUF file's own block format when every layer matrix
    is in one of Q8_0, Q4_0, Q4_1 (what :class:`~tformer.training.lora.LoRALinear` trains over and ``--merge``
    writes back), else ``fp32`` (a K-quant or mixed file, e.g. Q4_K_M, whose q, k and v differ in format; with
    the sentence saying so)."""
    from tformer.inference import resolve_source
    from tformer.interop.gguf_import import layer_formats
    from tformer.interop.gguf_reader import GGUFFile
    from tformer.quant.quantize import BLOCK_FORMATS

    _, source, kind = resolve_source(path)
    if kind != "gguf":
        return "fp32", None
    formats = layer_formats(GGUFFile(source))
    if len(formats) == 1 and formats <= set(BLOCK_FORMATS):
        return next(iter(formats)), None
    return "fp32", (f"QLoRA: {source} stores its layer matrices as {', '.join(sorted(formats))}; tformer trains "
                    f"over {', '.join(BLOCK_FORMATS)} blocks only, so the base is widened to float32")


def token_id(tokenizer, text: str | None) -> int | None:
    inner = getattr(tokenizer, "tok", None)
    return inner.token_to_id(text) if text and inner is not None and hasattr(inner, "token_to_id") else None


def read_template(folder: Path) -> ChatTemplate:
    """The folder's chat template (``chat_template.jinja``, else ``tokenizer_config.json``'s), else ChatML."""
    cfg = {}
    if (folder / "tokenizer_config.json").is_file():
        try:
            cfg = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        except ValueError as e:
            raise CheckpointError(f"{folder}/tokenizer_config.json is not JSON ({e}); restore it.") from None

    def text(v):
        return v.get("content", "") if isinstance(v, dict) else (v or "")

    source = cfg.get("chat_template")
    if isinstance(source, list):                      # named templates: take the default one
        source = next((t["template"] for t in source if t.get("name") == "default"), None)
    if (folder / "chat_template.jinja").is_file():
        source = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    return ChatTemplate(source or ChatTemplate.source, text(cfg.get("bos_token")), text(cfg.get("eos_token")))


# ---------------------------------------------------------------------------------------- the data
def load_examples(s: FinetuneSettings, tokenizer, template: ChatTemplate, stops) -> tuple[list, list, list]:
    """``(train, val, questions)``: examples and, for the built-in task, held-out questions."""
    if s.objective == "dpo":
        return load_pairs(s, tokenizer, template) + ([],)
    questions = []
    if s.data is None:
        train_convs, test_convs = number_task(s.n_train, s.n_test, s.max_number, s.seed)
        val = [truncate(chat_example(c, template, tokenizer), s.max_length) for c in test_convs]
        questions = [(prompt_ids(template, c[:1], tokenizer), c[1]["content"]) for c in test_convs[:s.eval_exact]]
        train = [truncate(chat_example(c, template, tokenizer), s.max_length) for c in train_convs]
        return train, val, questions
    path = Path(s.data)
    if not path.is_file():
        raise InputError(f"--data {s.data} is not a file; pass a chat .jsonl file or a plain-text file.")
    if path.suffix in (".jsonl", ".json"):
        examples = [truncate(chat_example(c, template, tokenizer), s.max_length) for c in read_chat(path, s.encoding)]
        examples = [e for e in examples if any(t != -100 for t in e[1][1:])]
        if not examples:
            raise InputError(f"no conversation of {path} keeps an answer token within max_length={s.max_length}; "
                             f"raise max_length.")
    else:
        try:
            examples = text_examples(path.read_text(encoding=s.encoding), tokenizer, s.max_length)
        except UnicodeDecodeError as e:
            raise InputError(f"{path} is not {s.encoding} text ({e.reason}); pass --set encoding=...") from None
    order = list(range(len(examples)))
    random.Random(s.seed).shuffle(order)
    n_val = min(len(examples) - 1, round(len(examples) * s.val_fraction)) if s.val_fraction else 0
    return [examples[i] for i in order[n_val:]], [examples[i] for i in order[:n_val]], questions


def load_pairs(s: FinetuneSettings, tokenizer, template: ChatTemplate) -> tuple[list, list]:
    """``(train, val)`` preference pairs ``(chosen example, rejected example)``: the built-in preference task
    (its ``n_test`` held out) or a preference JSONL (``val_fraction`` held out)."""
    def example(prompt, answer):
        return truncate(chat_example(prompt + [{"role": "assistant", "content": answer}], template, tokenizer),
                        s.max_length)

    def pairs(items):
        out = [(example(p, c), example(p, r)) for p, c, r in items]
        return [pr for pr in out if all(any(t != -100 for t in e[1][1:]) for e in pr)]
    if s.data is None:
        train, test = preference_task(s.n_train, s.n_test, s.max_number, s.seed)
        return pairs(train), pairs(test)
    path = Path(s.data)
    if not path.is_file() or path.suffix not in (".jsonl", ".json"):
        raise InputError(f"--data {s.data} is not a .jsonl file; objective=dpo reads preference pairs, one JSON "
                         f"object per line.")
    items = pairs(read_preferences(path, s.encoding))
    if not items:
        raise InputError(f"no pair of {path} keeps an answer token within max_length={s.max_length}; raise max_length.")
    order = list(range(len(items)))
    random.Random(s.seed).shuffle(order)
    n_val = min(len(items) - 1, round(len(items) * s.val_fraction)) if s.val_fraction else 0
    return [items[i] for i in order[n_val:]], [items[i] for i in order[:n_val]]


def prompt_ids(template: ChatTemplate, messages: list[dict], tokenizer) -> list[int]:
    """The tokens a model answering ``messages`` is given: the conversation, then the assistant header
    (tokenised piece by piece, as :func:`chat_example` does for training)."""
    done = template.render(messages)
    return chat_example(messages, template, tokenizer)[0] + \
        encode(tokenizer, template.render(messages, add_generation_prompt=True)[len(done):])


# ---------------------------------------------------------------------------------------- the run
class AdapterState(torch.nn.Module):
    """What a QLoRA run's checkpoints hold: the adapters alone (the base is the GGUF file, opened again on
    resume), under their names in the model, and the model's config."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.config, self.adapters = model.config, lora_parameters(model)

    def state_dict(self, *args, **kwargs) -> dict:
        return {n: p.detach() for n, p in self.adapters.items()}


def on_blocks(model: torch.nn.Module) -> bool:
    """Whether ``model``'s frozen base is (partly) a GGUF file's blocks (a block layer, or LoRA over one)."""
    return any(getattr(m, "fmt", None) for m in model.modules())


class FinetuneLoop(Loop):
    """The one loop, reading its LoRA checkpoints back itself: a step folder's ``model.safetensors``
    holds the base and the adapters, which :func:`tformer.checkpoint.load_model` (a base model) refuses;
    over a GGUF file's blocks (QLoRA) it holds the adapters only."""

    def checkpoint_model(self) -> torch.nn.Module:
        return AdapterState(self.model) if on_blocks(self.model) else self.model

    def resume(self, folder: Path, state: dict, opt_state: dict | None) -> None:
        from safetensors.torch import load_file
        if opt_state is None:
            raise CheckpointError(f"{folder} is sharded; tformer finetune resumes single-process checkpoints only.")
        weights = load_file(str(folder / WEIGHTS))
        missing, unexpected = self.model.load_state_dict(weights, strict=False)
        tied = {"lm_head.weight"} if getattr(self.model.config, "tie_embeddings", False) else set()
        if on_blocks(self.model):                      # the base is the file's: only the adapters were saved
            adapters = lora_parameters(self.model)
            missing = [k for k in missing if k in adapters]
        if set(missing) - tied or unexpected:
            raise CheckpointError(f"{folder}/{WEIGHTS} does not fit this run's model: missing {sorted(missing)[:3]}, "
                                  f"unexpected {sorted(unexpected)[:3]}; resume with the run's own settings.")
        self.optimizer.load_state_dict(opt_state["optimizer"])
        torch.set_rng_state(opt_state["torch_rng"])
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        self.elapsed, self.best_val = state["elapsed_s"], state["best_val_loss"]
        self.saved_step = state["step"]


def prepare(s: FinetuneSettings, log: Callable[[str], None] = print, resume: bool = False,
            given: set[str] | None = None) -> FinetuneLoop:
    """A new or resumed run, every check done (settings, model, data, run folder) before a step."""
    if distributed.under_torchrun():
        raise ConfigError("tformer finetune trains in one process; run it without torchrun.")
    out = Path(s.out_dir or "runs/finetune")
    check_run_folder(out)
    return locked_run(out, lambda: _resume(out, s, log, given or set()) if resume else _new(out, s, log))


def _new(out: Path, s: FinetuneSettings, log) -> FinetuneLoop:
    if (pointer := read_pointer(out, missing_ok=True)) is not None:
        raise InputError(f"{out} already holds a checkpoint (step {pointer['step']}); pass --resume to continue it, "
                         f"or choose another --out to start a new run.")
    if s.model is None:
        raise ConfigError("tformer finetune needs --model: a tformer checkpoint or a HuggingFace model folder.")
    model, tokenizer, template, stops = load_base(s.model, blocks=s.method == "lora" and s.qlora, log=log)
    torch.manual_seed(s.seed)
    if s.method == "lora":
        add_lora(model, s.lora_spec(model))
    loop = _loop(model, tokenizer, template, stops, s, out, log)
    start_metrics(out, None)
    return loop


def _loop(model, tokenizer, template, stops, s, out, log, reference: dict | None = None) -> FinetuneLoop:
    train, val, questions = load_examples(s, tokenizer, template, stops)
    pad = stops[0] if stops else 0
    if s.objective == "dpo":
        if not isinstance(model, DecoderLM):
            raise ConfigError(f"objective=dpo needs a decoder language model; {type(model).__name__} is not one.")
        task = PreferenceTask(train, val, s, tokenizer, pad, stops, reference)
    else:
        task = FinetuneTask(train, val, s, tokenizer, pad, questions, stops,
                            labelled_only=isinstance(model, DecoderLM), share_prefix=s.share_prefix)
    base_state = task.state

    blocks = on_blocks(model)

    def state() -> dict:      # what resume needs beyond the weights
        return {**base_state(), "chat_template": dataclasses.asdict(template), "stop_ids": list(stops),
                "base_blocks": blocks}

    task.state = state
    loop = FinetuneLoop(model.train(), task, s, out_dir=out, log=log,
                        resume_hint=f"tformer finetune --resume --out {out}")
    if s.objective == "dpo" and reference is None and s.dpo_loss not in REFERENCE_FREE:
        # the model as it starts (LoRA's B = 0: the base), on the run's device and precision; once, before any step
        log(f"reference log-probabilities of {len(train) + len(val)} pairs (once, kept in the checkpoints) ...")
        task.compute_reference(loop.model, loop.device, loop.dtype)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if blocks:
        held = [m for m in model.modules() if getattr(m, "fmt", None)]
        fmts = sorted({m.fmt for m in held})
        weights = sum(getattr(m, "in_features", 0) * getattr(m, "out_features", 0)
                      or getattr(m, "num_embeddings", 0) * getattr(m, "embedding_dim", 0) for m in held)
        log(f"QLoRA: the frozen base is the file's {', '.join(fmts)} blocks ({weights:,} weights, not counted "
            f"below), multiplied in float tile by tile")
    log(f"{s.method}: {trainable:,} of {sum(p.numel() for p in model.parameters()):,} parameters trained; "
        f"{len(train)} training / {len(val)} held-out examples" + (f", {len(questions)} questions" if questions else ""))
    return loop


def _resume(out: Path, s: FinetuneSettings, log, given: set[str]) -> FinetuneLoop:
    if not out.is_dir() or read_pointer(out, missing_ok=True) is None:
        raise InputError(f"nothing to resume: {out} holds no checkpoint; drop --resume to start a run.")
    folder, state, opt_state = read_latest(out)
    saved = state["train_config"]
    if "method" not in saved:
        raise CheckpointError(f"{out} is not a tformer finetune run; resume it with the command that made it.")
    asked = {k: getattr(s, k) for k in given if k != "out_dir"}
    s = resumed_settings(FinetuneSettings, state, asked, RESUME_KEEPS, folder, out)
    if state.get("base_blocks"):                      # QLoRA: the base is the file's blocks, opened again
        model = load_base(s.model, blocks=True)[0]
    else:
        config, _ = load_config(folder)
        model = build_model(config)
    if s.method == "lora":
        add_lora(model, s.lora_spec(model))
    template = ChatTemplate(**state["chat_template"])
    loop = _loop(model, load_tokenizer(folder), template, tuple(state["stop_ids"]), s, out, log,
                 reference=state.get("reference_logps"))
    if loop.task.fingerprint != state["corpus_fingerprint"]:
        raise InputError(f"the data {s.data or '(built-in task)'} differs from what the checkpoint in {folder} was "
                         f"trained on; resume with the original --data or start a new run with another --out.")
    loop.resume(folder, state, opt_state)
    start_metrics(out, loop.step)
    log(f"resumed {out} at step {loop.step} from {folder}")
    return loop


# the block format merged.gguf is written in, for a base in a 4-bit format: SmolLM2's Q4_1 merge written back
# as Q4_1 answered 0 of 10 held-out questions right, as Q8_0 all 10 (docs/finetune.md, QLoRA)
MERGED_FORMAT = {"q4_0": "q8_0", "q4_1": "q8_0"}


def finish(loop: FinetuneLoop) -> dict:
    """After the run: ``adapter/`` (LoRA) and, with ``merge``, ``merged/``; a summary."""
    s, out, model = loop.cfg, loop.out_dir, loop.model
    written = {}
    if s.method == "lora":
        written["adapter"] = str(save_adapter(model, out / "adapter", base_model=s.model))
    if s.merge or s.method == "full":
        merged = out / "merged"
        fmt = base_format(model)
        plain = merge_lora(_copy(model)) if s.method == "lora" else model
        widen_blocks(plain)
        save_model(merged, plain, generation={"eos_token_id": list(loop.task.stop_ids)})
        loop.task.tokenizer.save(merged / "tokenizer.json")
        template = loop.task.state()["chat_template"]["source"]
        atomic_write(merged / "chat_template.jinja", lambda tmp: Path(tmp).write_text(template, encoding="utf-8"))
        written["merged"] = str(merged)
        if fmt is not None:                            # back to a block format, for llama.cpp
            from tformer.interop.gguf import save_gguf
            kept = MERGED_FORMAT.get(fmt, fmt)
            if kept != fmt:
                loop.log(f"merged.gguf in {kept}, not the base's {fmt}: rounding the merged weights to 4 bits again "
                    f"rounds most of the adapters' update away")
            save_gguf(plain, out / "merged.gguf", kept, tokenizer_dir=merged, eos=list(loop.task.stop_ids))
            written["merged GGUF"] = str(out / "merged.gguf")
    return written


def _copy(model: torch.nn.Module) -> torch.nn.Module:
    import copy
    return copy.deepcopy(model)


def base_format(model: torch.nn.Module) -> str | None:
    """The block format of ``model``'s (merged) layer matrices, ``None`` for a float model: the most common
    one among its block layers (a GGUF file's embedding may be in another)."""
    from collections import Counter
    fmts = Counter(m.fmt for m in model.modules() if isinstance(m, BlockLinear) or getattr(m, "lora_A", None)
                   and getattr(m, "fmt", None))
    return fmts.most_common(1)[0][0] if fmts else None


def widen_blocks(model: torch.nn.Module) -> torch.nn.Module:
    """Every block layer of ``model`` as its float32 module (dequantised), in place; a head tied to the
    embedding stays tied."""
    from tformer.quant.block_embedding import BlockEmbedding
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, BlockLinear):
                lin = torch.nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                with torch.no_grad():
                    lin.weight.copy_(child.dequantized())
                    if child.bias is not None:
                        lin.bias.copy_(child.bias)
                setattr(module, name, lin)
            elif isinstance(child, BlockEmbedding):
                setattr(module, name, torch.nn.Embedding.from_pretrained(child.dequantized(), freeze=False))
    if getattr(model.config, "tie_embeddings", False) and hasattr(model, "lm_head"):
        model.lm_head.weight = model.tok_emb.weight
    return model
