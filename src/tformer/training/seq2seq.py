"""Training and evaluating sequence-to-sequence models (``tformer train --task seq2seq``).

Every family registered for pairs (the transformer ``encoder-decoder``, ``bahdanau``,
``rnn-encoder-decoder``) trains on :class:`PairsTask` with the one training loop
(:mod:`tformer.training.loop`): label-smoothed cross-entropy on teacher-forced targets, AdamW with
linear warm-up and cosine decay, gradient clipping; the loop's run lock, atomic checkpoints every
``eval_interval`` steps, SIGTERM save and exact resume (``--resume``), with every setting checked
before the first step. Each evaluation reports the teacher-forced loss on the held-out split; at the
end the held-out split is decoded (beam search) for corpus BLEU and chrF (``sacrebleu``) and the
exact-match rate.

A run folder is a ``tformer train`` run folder: ``ckpt/step-N/`` (the model, ``tokenizer.json``
holding the word vocabulary, ``trainer.json`` holding these settings, the optimizer state), the
``checkpoint.json`` pointer, ``metrics.jsonl``, and ``metrics.json`` with the final scores.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from tformer.checkpoint import CONFIG, POINTER, load_config, load_model, read_pointer, resolve_checkpoint
from tformer.config import TransformerConfig
from tformer.errors import CheckpointError, ConfigError, InputError
from tformer.exits import STOP_SIGNALS
from tformer.generation.beam import beam_search
from tformer.io import atomic_write_json
from tformer.models import build_model
from tformer.training import distributed
from tformer.training.config import MODEL_KEYS, TrainConfig, cast_value, check_model_settings
from tformer.training.loop import Loop
from tformer.training.runlock import check_run_folder, locked_run
from tformer.training.runs import TRAINER_STATE
from tformer.training.runstate import read_latest, resumed_settings, start_metrics
from tformer.training.seq2seq_data import (BOS, EOS, WordTokenizer, make_batch, number_pairs, read_pairs,
                                           split_pairs)
from tformer.training.tasks.base import Task, step_generator

TOKENIZER, SETTINGS, METRICS = "seq2seq_tokenizer.json", "seq2seq.json", "metrics.json"   # the last two: old runs


# The architecture of a run: TransformerConfig fields (``--set d_model=...`` overrides any of them).
MODEL_DEFAULTS = dict(model="encoder-decoder", d_model=64, n_heads=4, n_layers=2, encoder_layers=2, d_ff=256,
                      norm_placement="post", positions="sinusoidal", dropout=0.1, context_length=128,
                      activation="relu")
RNN_DEFAULTS = dict(n_layers=1, encoder_layers=None)      # the RNNs: one GRU layer per side

# TrainConfig fields that only language modelling reads: refused for --task seq2seq.
LM_ONLY = ("tokenizer", "bpe_vocab_size", "val_fraction", "cache_dir", "grad_accum", "eval_batches", "sample_tokens",
           "sample_prompt", "strategy", "dist_timeout", "max_hours")
# What a resumed run must keep: the data, its split, the vocabulary and the model.
RESUME_KEEPS = ("data", "encoding", "n_train", "n_test", "max_digits", "test_fraction", "seed", "architecture")


@dataclass
class Seq2SeqSettings(TrainConfig):
    """Everything a ``--task seq2seq`` run reads (``--set key=value``): :class:`TrainConfig`'s
    optimisation, schedule, precision, checkpoint and time fields (with the defaults below) and this
    task's own. The fields of :data:`LM_ONLY` are not used.

    Args:
        data: TSV pairs (file, folder, glob) read with ``encoding``; ``None`` = the built-in numbers task
            (English -> French words).
        n_train, n_test, max_digits: the built-in task's size and longest number.
        test_fraction: share of a TSV held out for testing.
        label_smoothing: mass spread uniformly over the vocabulary in the training loss.
        beams, length_penalty, eval_max: decoding of the test split (``eval_max`` pairs at most; 0 = all).
        architecture: TransformerConfig fields over :data:`MODEL_DEFAULTS` (``model`` is the family:
            ``encoder-decoder``, ``bahdanau`` or ``rnn-encoder-decoder``; the RNNs read ``d_model``
            and ``dropout``); ``--set`` puts every TransformerConfig key here, as ``tformer train`` does.
    """

    out_dir: str | None = "runs/seq2seq"
    batch_size: int = 32
    max_steps: int = 1500
    warmup_steps: int = 150
    weight_decay: float = 0.01
    beta2: float = 0.98                     # Vaswani's betas: 0.9, 0.98
    device: str = "cpu"
    seed: int = 0
    n_train: int = 20000
    n_test: int = 500
    max_digits: int = 9
    test_fraction: float = 0.05
    label_smoothing: float = 0.1
    beams: int = 4
    length_penalty: float = 1.0
    eval_max: int = 500
    architecture: dict = dataclasses.field(default_factory=dict)

    RANGES = {"n_train": (1, None, True, True), "n_test": (1, None, True, True), "max_digits": (1, 15, True, True),
              "test_fraction": (0.0, 1.0, False, False), "label_smoothing": (0.0, 1.0, True, False),
              "beams": (1, None, True, True), "length_penalty": (None, None, True, True),
              "eval_max": (0, None, True, True)}

    def __post_init__(self) -> None:
        super().__post_init__()
        check_model_settings(self.architecture)
        self.model_config(vocab_size=16)          # the architecture's own refusals, before any data is read

    @classmethod
    def from_strings(cls, values: dict[str, Any]) -> "Seq2SeqSettings":
        """Settings from ``--set`` strings, cast to each field's type: this run's own fields, and
        TransformerConfig's (into ``architecture``); unknown keys are refused."""
        own = [f.name for f in dataclasses.fields(cls) if f.name != "architecture" and f.name not in LM_ONLY]
        out, arch = {}, {}
        for key, value in values.items():
            if key in own:
                out[key] = cast_value(key, value, schema=cls)
            elif key in MODEL_KEYS:
                arch[key] = cast_value(key, value)
            else:
                raise ConfigError(f"unknown setting {key!r} for --task seq2seq; valid keys are: "
                                  f"{', '.join(sorted(own + list(MODEL_KEYS)))}.")
        return cls(**out, architecture=arch)

    @property
    def model(self) -> str:
        """The model family."""
        return self.architecture.get("model", MODEL_DEFAULTS["model"])

    def model_config(self, vocab_size: int) -> TransformerConfig:
        kw = {**MODEL_DEFAULTS, **(RNN_DEFAULTS if self.model != "encoder-decoder" else {}), **self.architecture}
        kw.setdefault("embedding_scale", kw["positions"] == "sinusoidal")
        return TransformerConfig(vocab_size=vocab_size, **kw)


class PairsTask(Task):
    """Teacher-forced translation of sentence pairs: step s's batch is ``batch_size`` training pairs
    drawn with a generator seeded from ``(seed, s)``; each evaluation's ``val_loss`` is the mean
    teacher-forced loss (no smoothing) over the first ``eval_max`` held-out pairs."""

    def __init__(self, train: list, test: list, tok: WordTokenizer, s: Seq2SeqSettings):
        self.train, self.test, self.tokenizer, self.s = train, test, tok, s
        self.fingerprint = hashlib.sha256(json.dumps([train, test]).encode()).hexdigest()[:16]

    def batch(self, step: int) -> dict:
        idx = torch.randint(len(self.train), (self.s.batch_size,), generator=step_generator(self.s.seed, step))
        return make_batch([self.train[i] for i in idx.tolist()], self.tokenizer)

    def loss(self, forward, b: dict, label_smoothing: float | None = None) -> torch.Tensor:
        smoothing = self.s.label_smoothing if label_smoothing is None else label_smoothing
        _, loss = forward(b["src"], b["tgt"], b["targets"], src_mask=b["src_mask"], tgt_mask=b["tgt_mask"],
                          label_smoothing=smoothing)
        return loss

    def evaluate(self, loop) -> dict[str, float]:
        pairs = self.test[: self.s.eval_max or None]
        total = 0.0
        for i in range(0, len(pairs), 64):
            b = make_batch(pairs[i:i + 64], self.tokenizer, loop.device)
            total += float(self.loss(loop.forward, b, label_smoothing=0.0)) * len(pairs[i:i + 64])
        return {"val_loss": total / len(pairs)}

    def state(self) -> dict:
        return {"corpus_fingerprint": self.fingerprint}


def load_data(s: Seq2SeqSettings) -> tuple[list, list]:
    if s.data is None:
        return number_pairs(s.n_train, s.n_test, seed=s.seed, max_digits=s.max_digits)
    return split_pairs(read_pairs(s.data, s.encoding), s.test_fraction, seed=s.seed)


def train(s: Seq2SeqSettings, log: Callable[[str], None] = print, data: tuple | None = None,
          resume: bool = False, given: set[str] | None = None) -> dict:
    """Train (or, with ``resume``, continue the run in ``s.out_dir``), evaluate on the held-out split;
    returns the metrics (``stopped``: why the run ended early, else ``None``).

    ``given``: on resume, the settings of ``s`` that override the saved ones (the others are the
    saved run's); default: every field that differs from its default.

    Raises:
        InputError / ConfigError / CheckpointError: a run folder in use or holding another run, a resume
            with other data or another model, bad data; all before the first step.
    """
    if distributed.under_torchrun() and int(os.environ["WORLD_SIZE"]) > 1:
        raise ConfigError("--task seq2seq trains in one process; run it without torchrun.")
    out = Path(s.out_dir or "runs/seq2seq")
    check_run_folder(out)
    loop = locked_run(out, lambda: _resume(out, s, log, given) if resume else _new(out, s, log, data))
    task = loop.task
    log(f"{loop.cfg.model}: {loop.model.num_parameters():,} parameters, vocabulary {task.tokenizer.vocab_size}, "
        f"{len(task.train)} training / {len(task.test)} test pairs")
    summary = loop.fit()
    s = loop.cfg
    if summary["stopped"] in STOP_SIGNALS.values():
        return {"stopped": summary["stopped"], "steps": loop.step}
    losses = [r["loss"] for r in summary["history"] if "loss" in r and r["step"] > loop.step - 50]
    metrics = evaluate(loop.model, task.tokenizer, task.test[: s.eval_max or None], beams=s.beams,
                       length_penalty=s.length_penalty)
    metrics.update(steps=loop.step, train_seconds=round(loop.elapsed, 1), parameters=loop.model.num_parameters(),
                   final_loss=sum(losses) / len(losses) if losses else math.nan, stopped=summary["stopped"])
    atomic_write_json(out / METRICS, metrics)
    log(f"test: BLEU {metrics['bleu']:.1f}, chrF {metrics['chrf']:.1f}, exact match {metrics['exact']:.1%} "
        f"({metrics['n']} pairs, beam {s.beams}); {loop.step} steps in {loop.elapsed:.0f} s; saved to {out}")
    return metrics


def _loop(model: torch.nn.Module, task: PairsTask, s: Seq2SeqSettings, out: Path, log) -> Loop:
    return Loop(model, task, s, out_dir=out, log=log, resume_hint=f"tformer train --task seq2seq --resume --out {out}")


def _new(out: Path, s: Seq2SeqSettings, log, data) -> Loop:
    if (pointer := read_pointer(out, missing_ok=True)) is not None or (out / CONFIG).is_file():
        held = f"a checkpoint (step {pointer['step']})" if pointer else "a trained model"
        raise InputError(f"{out} already holds {held}; pass --resume to continue it, or choose another --out "
                         f"to start a new run.")
    train_pairs, test_pairs = data or load_data(s)
    tok = WordTokenizer.train([t for p in train_pairs for t in p])
    torch.manual_seed(s.seed)
    model = build_model(s.model_config(tok.vocab_size))
    start_metrics(out, None)
    return _loop(model, PairsTask(train_pairs, test_pairs, tok, s), s, out, log)


def _resume(out: Path, s: Seq2SeqSettings, log, given: set[str] | None) -> Loop:
    if not out.is_dir() or read_pointer(out, missing_ok=True) is None:
        raise InputError(f"nothing to resume: {out} holds no seq2seq checkpoint; drop --resume to start a run, "
                         f"or pass the --out folder of an earlier `tformer train --task seq2seq`.")
    folder, state, opt_state = read_latest(out)
    saved = state["train_config"]
    if "label_smoothing" not in saved:
        raise CheckpointError(f"{out} is a language-model run, not a seq2seq one; resume it without --task seq2seq.")
    if given is None:
        given = {f.name for f in dataclasses.fields(s) if getattr(s, f.name) != Seq2SeqSettings().__dict__[f.name]}
    given = {k: getattr(s, k) for k in given if k != "out_dir"}
    if "architecture" in given:                              # the keys given, over the saved architecture
        given["architecture"] = {**saved.get("architecture", {}), **given["architecture"]}
    s = resumed_settings(Seq2SeqSettings, state, given, RESUME_KEEPS, folder, out)
    train_pairs, test_pairs = load_data(s)
    task = PairsTask(train_pairs, test_pairs, WordTokenizer.load(folder / "tokenizer.json"), s)
    if task.fingerprint != state["corpus_fingerprint"]:
        raise InputError(f"the pairs {s.data or '(built-in task)'} differ from the ones the checkpoint in {folder} "
                         f"was trained on; resume with the original --data or start a new run with another --out.")
    saved_config, _ = load_config(folder)
    loop = _loop(build_model(saved_config), task, s, out, log)
    loop.resume(folder, state, opt_state)
    start_metrics(out, loop.step)
    log(f"resumed {out} at step {loop.step} from {folder}")
    return loop


@torch.no_grad()
def translate(model, tok: WordTokenizer, sources: list[str], *, beams: int = 4, length_penalty: float = 1.0,
              max_new_tokens: int | None = None, batch_size: int = 64) -> list[str]:
    """Translate ``sources`` (beam search; ``beams=1`` is greedy)."""
    model.eval()
    device = next(model.parameters()).device
    out = []
    for i in range(0, len(sources), batch_size):
        b = make_batch([(s, "") for s in sources[i:i + batch_size]], tok, device)
        limit = max_new_tokens or 2 * b["src"].shape[1] + 10
        hyps = beam_search(model, b["src"], b["src_mask"], bos=BOS, eos=EOS, num_beams=beams,
                           max_new_tokens=limit, length_penalty=length_penalty)
        out += [tok.decode(h[0].tokens) for h in hyps]
    return out


def evaluate(model, tok: WordTokenizer, pairs: list, **kw) -> dict:
    """Corpus BLEU, chrF and exact match of the model's translations of ``pairs``."""
    import sacrebleu

    hyps = translate(model, tok, [s for s, _ in pairs], **kw)
    refs = [t for _, t in pairs]
    return {"bleu": sacrebleu.corpus_bleu(hyps, [refs]).score, "chrf": sacrebleu.corpus_chrf(hyps, [refs]).score,
            "exact": sum(h == r for h, r in zip(hyps, refs)) / len(refs), "n": len(refs),
            "examples": [{"source": s, "reference": r, "output": h} for (s, r), h in list(zip(pairs, hyps))[:5]]}


def load_run(run: str):
    """``(model, tokenizer, settings dict)`` of a ``--task seq2seq`` run folder (its latest
    checkpoint), or of a folder written before runs had checkpoints (``seq2seq_tokenizer.json``)."""
    folder = Path(run)
    if (folder / TOKENIZER).is_file() and (folder / CONFIG).is_file():           # an older, flat run folder
        settings = json.loads((folder / SETTINGS).read_text()) if (folder / SETTINGS).is_file() else {}
        return load_model(folder).eval(), WordTokenizer.load(folder / TOKENIZER), settings
    if not (folder / POINTER).is_file():
        raise CheckpointError(f"{run} is not a seq2seq run folder (it has no {POINTER}); pass the --out folder of "
                              f"`tformer train --task seq2seq`.")
    ckpt = resolve_checkpoint(folder)
    words, state = ckpt / "tokenizer.json", ckpt / TRAINER_STATE
    try:
        kind = json.loads(words.read_text(encoding="utf-8")).get("kind") if words.is_file() else None
        settings = json.loads(state.read_text(encoding="utf-8")).get("train_config", {}) if state.is_file() else {}
    except (OSError, ValueError, AttributeError) as e:
        raise CheckpointError(f"cannot read {ckpt}'s tokenizer or trainer state ({e}); restore the checkpoint "
                              f"or train again.") from None
    if kind != "seq2seq-words":
        raise CheckpointError(f"{run} is not a seq2seq run folder (its checkpoint has no word vocabulary); pass the "
                              f"--out folder of `tformer train --task seq2seq`.")
    return load_model(ckpt).eval(), WordTokenizer.load(words), settings


def scores_by_length(model, tok: WordTokenizer, pairs: list, edges: tuple[int, ...] = (5, 10, 15, 20, 25),
                     **kw) -> list[dict]:
    """BLEU, chrF and exact match of ``pairs`` grouped by source length in tokens (Bahdanau et al.,
    Fig. 2): one row per bucket ``(lo, hi]`` of ``edges``, the last one open-ended."""
    import sacrebleu

    hyps = translate(model, tok, [s for s, _ in pairs], **kw)
    rows, lo = [], 0
    for hi in list(edges) + [10 ** 9]:
        sel = [(h, r) for (s, r), h in zip(pairs, hyps) if lo < len(tok.encode(s)) <= hi]
        if sel:
            hs, rs = [h for h, _ in sel], [r for _, r in sel]
            rows.append({"lengths": f"{lo + 1}-{hi}" if hi < 10 ** 9 else f">{lo}", "n": len(sel),
                         "bleu": sacrebleu.corpus_bleu(hs, [rs]).score, "chrf": sacrebleu.corpus_chrf(hs, [rs]).score,
                         "exact": sum(h == r for h, r in sel) / len(sel)})
        lo = hi
    return rows
