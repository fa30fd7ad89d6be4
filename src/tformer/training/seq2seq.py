"""Training and evaluating sequence-to-sequence models (``tformer train --task seq2seq``).

One loop trains every family registered for pairs (the transformer ``encoder-decoder``,
``bahdanau``, ``rnn-encoder-decoder``): label-smoothed cross-entropy on teacher-forced targets,
AdamW with linear warmup and cosine decay, gradient clipping. Evaluation decodes the held-out
split (beam search) and reports corpus BLEU and chrF (``sacrebleu``) and the exact-match rate.

A run folder holds ``model.safetensors`` + ``tformer_config.json`` (the usual checkpoint),
``seq2seq_tokenizer.json``, ``seq2seq.json`` (these settings) and ``metrics.json``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from tformer.checkpoint import CONFIG, load_model, save_model
from tformer.io import atomic_write_json
from tformer.config import TransformerConfig
from tformer.errors import CheckpointError, ConfigError
from tformer.generation.beam import beam_search
from tformer.models import build_model
from tformer.training.optim import lr_at, make_optimizer
from tformer.training.seq2seq_data import (BOS, EOS, WordTokenizer, make_batch, number_pairs, read_pairs,
                                           split_pairs)

TOKENIZER, SETTINGS, METRICS = "seq2seq_tokenizer.json", "seq2seq.json", "metrics.json"


# The architecture of a run: TransformerConfig fields (``--set d_model=...`` overrides any of them).
MODEL_DEFAULTS = dict(model="encoder-decoder", d_model=64, n_heads=4, n_layers=2, encoder_layers=2, d_ff=256,
                      norm_placement="post", positions="sinusoidal", dropout=0.1, context_length=128,
                      activation="relu")
RNN_DEFAULTS = dict(n_layers=1, encoder_layers=None)      # the RNNs: one GRU layer per side


@dataclass
class Seq2SeqSettings:
    """Everything a ``--task seq2seq`` run reads (``--set key=value``).

    Args:
        data: TSV pairs (file, folder, glob); ``None`` = the built-in numbers task (English -> French words).
        out_dir: run folder.
        n_train, n_test, max_digits: the built-in task's size and longest number.
        test_fraction: share of a TSV held out for testing.
        batch_size, max_steps, lr, warmup_steps, weight_decay, grad_clip, label_smoothing: the optimisation.
        beams, length_penalty, eval_max: decoding of the test split (``eval_max`` pairs at most; 0 = all).
        seed, threads (0 = keep torch's), time_limit (seconds, 0 = none), progress.
        architecture: TransformerConfig fields over :data:`MODEL_DEFAULTS` (``model`` is the family:
            ``encoder-decoder``, ``bahdanau`` or ``rnn-encoder-decoder``; the RNNs read ``d_model``
            and ``dropout``); ``--set`` puts every TransformerConfig key here, as ``tformer train`` does.
    """

    data: str | None = None
    out_dir: str = "runs/seq2seq"
    n_train: int = 20000
    n_test: int = 500
    max_digits: int = 9
    test_fraction: float = 0.05
    batch_size: int = 32
    max_steps: int = 1500
    lr: float = 1e-3
    warmup_steps: int = 150
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    label_smoothing: float = 0.1
    beams: int = 4
    length_penalty: float = 1.0
    eval_max: int = 500
    seed: int = 0
    threads: int = 0
    time_limit: float = 0.0
    progress: bool = True
    architecture: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def from_strings(cls, values: dict[str, Any]) -> "Seq2SeqSettings":
        """Settings from ``--set`` strings, cast to each field's type: this run's own fields, and
        TransformerConfig's (into ``architecture``); unknown keys are refused."""
        from tformer.training.config import MODEL_KEYS, cast_value

        own = [f.name for f in dataclasses.fields(cls) if f.name != "architecture"]
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


def load_data(s: Seq2SeqSettings) -> tuple[list, list]:
    if s.data is None:
        return number_pairs(s.n_train, s.n_test, seed=s.seed, max_digits=s.max_digits)
    return split_pairs(read_pairs(s.data), s.test_fraction, seed=s.seed)


def train(s: Seq2SeqSettings, log: Callable[[str], None] = print, data: tuple | None = None) -> dict:
    """Train, evaluate on the held-out split, save to ``s.out_dir``; returns the metrics."""
    if s.threads:
        torch.set_num_threads(s.threads)
    torch.manual_seed(s.seed)
    train_pairs, test_pairs = data or load_data(s)
    tok = WordTokenizer.train([t for p in train_pairs for t in p])
    model = build_model(s.model_config(tok.vocab_size))
    opt = make_optimizer(model, s.lr, (0.9, 0.98), s.weight_decay)                # Vaswani's betas
    log(f"{s.model}: {model.num_parameters():,} parameters, vocabulary {tok.vocab_size}, "
        f"{len(train_pairs)} training / {len(test_pairs)} test pairs")
    gen = torch.Generator().manual_seed(s.seed)
    start, losses = time.perf_counter(), []
    from tqdm import tqdm
    bar = tqdm(range(s.max_steps), disable=not s.progress, unit="step", dynamic_ncols=True)
    for step in bar:
        idx = torch.randint(len(train_pairs), (s.batch_size,), generator=gen).tolist()
        b = make_batch([train_pairs[i] for i in idx], tok)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, lr=s.lr, min_lr=s.lr / 10, warmup_steps=s.warmup_steps, decay_steps=s.max_steps)
        model.train()
        _, loss = model(b["src"], b["tgt"], b["targets"], src_mask=b["src_mask"], tgt_mask=b["tgt_mask"],
                        label_smoothing=s.label_smoothing)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if s.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
        opt.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
        if s.time_limit and time.perf_counter() - start > s.time_limit:
            log(f"time limit reached at step {step + 1}")
            break
    train_seconds = time.perf_counter() - start
    metrics = evaluate(model, tok, test_pairs[: s.eval_max or None], beams=s.beams, length_penalty=s.length_penalty)
    metrics.update(steps=len(losses), train_seconds=round(train_seconds, 1), final_loss=sum(losses[-50:]) / len(losses[-50:]),
                   parameters=model.num_parameters())
    save_run(s.out_dir, model, tok, s, metrics)
    log(f"test: BLEU {metrics['bleu']:.1f}, chrF {metrics['chrf']:.1f}, exact match {metrics['exact']:.1%} "
        f"({metrics['n']} pairs, beam {s.beams}); {len(losses)} steps in {train_seconds:.0f} s; saved to {s.out_dir}")
    return metrics


@torch.no_grad()
def translate(model, tok: WordTokenizer, sources: list[str], *, beams: int = 4, length_penalty: float = 1.0,
              max_new_tokens: int | None = None, batch_size: int = 64) -> list[str]:
    """Translate ``sources`` (beam search; ``beams=1`` is greedy)."""
    model.eval()
    out = []
    for i in range(0, len(sources), batch_size):
        b = make_batch([(s, "") for s in sources[i:i + batch_size]], tok)
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


def save_run(out_dir: str, model, tok: WordTokenizer, s: Seq2SeqSettings, metrics: dict) -> None:
    out = Path(out_dir)
    save_model(out, model)
    tok.save(out / TOKENIZER)
    atomic_write_json(out / SETTINGS, dataclasses.asdict(s))
    atomic_write_json(out / METRICS, metrics)


def load_run(run: str):
    """``(model, tokenizer, settings dict)`` of a ``--task seq2seq`` run folder."""
    folder = Path(run)
    if not (folder / TOKENIZER).is_file() or not (folder / CONFIG).is_file():
        raise CheckpointError(f"{run} is not a seq2seq run folder ({TOKENIZER} or {CONFIG} is missing); pass the "
                              f"--out folder of `tformer train --task seq2seq`.")
    model = load_model(folder)
    settings = json.loads((folder / SETTINGS).read_text()) if (folder / SETTINGS).is_file() else {}
    return model.eval(), WordTokenizer.load(folder / TOKENIZER), settings


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


def run_command(args, settings: dict) -> int:
    """``tformer train --task seq2seq``: the hook the train command calls."""
    if args.preset or args.resume:
        raise ConfigError("--task seq2seq takes no --preset or --resume; set the model with --set model=... "
                          "(encoder-decoder, bahdanau, rnn-encoder-decoder) and sizes with --set d_model=... .")
    settings.pop("preset", None)
    if args.data is not None:
        settings["data"] = args.data
    if args.out is not None:
        settings["out_dir"] = args.out
    s = Seq2SeqSettings.from_strings(settings)
    metrics = train(s, log=lambda m: print(m, flush=True))
    for ex in metrics["examples"][:3]:
        print(f"  {ex['source']!r} -> {ex['output']!r} (reference {ex['reference']!r})")
    print(f"--- more: tformer translate --ckpt {s.out_dir} \"...\" --beams 4 ---")
    return 0
