"""``tformer finetune --set objective=dpo`` end to end on a random-initialised small Llama (HF folder): the
preference JSONL formats, bad lines, the reference log-probabilities (computed once, equal to transformers'
on the base, kept in the checkpoint and read back on resume), the step-0 DPO loss ``log 2``, learning, and
exact resume."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("num2words")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
from finetune_fixtures import tiny_llama  # noqa: E402
from tformer.cli import main  # noqa: E402
from tformer.errors import InputError  # noqa: E402
from tformer.tokenizers import load_tokenizer  # noqa: E402
from tformer.training.chat_data import CHATML, ChatTemplate  # noqa: E402
from tformer.training.preference_data import parse_pair, preference_task, read_preferences, wrong_number  # noqa: E402

QUICK = ["--set", "objective=dpo", "--set", "n_train=40", "--set", "n_test=8", "--set", "max_number=99",
         "--set", "progress=false", "--set", "threads=1", "--set", "batch_size=4", "--set", "max_length=48",
         "--set", "eval_batches=2", "--set", "precision=fp32"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("base"))


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_the_three_jsonl_shapes_give_the_same_pair(tmp_path):
    user = [{"role": "user", "content": "Write 7 in French words."}]
    lines = [{"prompt": "Write 7 in French words.", "chosen": "sept", "rejected": "seven"},
             {"prompt": user, "chosen": [{"role": "assistant", "content": "sept"}],
              "rejected": [{"role": "assistant", "content": "seven"}]},
             {"chosen": user + [{"role": "assistant", "content": "sept"}],
              "rejected": user + [{"role": "assistant", "content": "seven"}]}]
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    pairs = read_preferences(path)
    assert pairs == [(user, "sept", "seven")] * 3


@pytest.mark.parametrize("obj,msg", [
    ({"prompt": "x", "chosen": "a"}, "no \"chosen\" and \"rejected\""),
    ({"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
      "rejected": [{"role": "user", "content": "other"}, {"role": "assistant", "content": "b"}]}, "same conversation"),
    ({"prompt": "x", "chosen": [{"role": "user", "content": "a"}], "rejected": "b"}, "one assistant answer"),
    ({"prompt": "x", "chosen": 3, "rejected": "b"}, "must be a string or a non-empty list"),
])
def test_a_bad_pair_is_refused_in_one_sentence(obj, msg):
    with pytest.raises(InputError, match=msg):
        parse_pair(obj, "f.jsonl line 3")


def test_a_bad_line_fails_the_command_with_its_number(base, tmp_path, capsys):
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"prompt": "q", "chosen": "a", "rejected": "b"}) + "\n{not json\n")
    assert main(["finetune", "--model", str(base), "--data", str(data), "--out", str(tmp_path / "r"), *QUICK]) == 2
    err = capsys.readouterr().err
    assert "line 2 is not JSON" in err and "Traceback" not in err


def test_the_built_in_pairs_are_right_and_wrong_answers():
    from num2words import num2words
    train, test = preference_task(30, 10, 999, seed=0)
    assert len(train) == 30 and len(test) == 10
    numbers = [int(p[0]["content"].split()[1]) for p, _, _ in train + test]
    assert len(set(numbers)) == 40
    for k, ((prompt, chosen, rejected), x) in enumerate(zip(train + test, numbers)):
        assert chosen == num2words(x, lang="fr") and rejected != chosen
        if k % 2 == 0:
            assert rejected == num2words(x, lang="en")
    import random
    rng = random.Random(0)
    for x in (0, 7, 10, 437, 999):
        y = wrong_number(x, rng)
        assert y != x and len(str(y)) == len(str(x)) and sum(a != b for a, b in zip(str(x), str(y))) == 1
    assert wrong_number(437, rng, avoid=frozenset(range(1000)) - {487}) == 487
    assert wrong_number(5, rng, avoid=frozenset(range(10))) is None


def test_no_held_out_answer_is_taught_in_training():
    """A held-out pair's answers are neither answer of a training pair (the changed numbers avoid the other
    split): at 400 / 100 of 0..999 the earlier generator put 7 held-out right answers among the training
    rejections and 15 held-out rejections among the training right answers."""
    from num2words import num2words
    train, test = preference_task(400, 100, 999, seed=0)
    taught = {a for _, c, r in train for a in (c, r)}
    assert not taught & {a for _, c, r in test for a in (c, r)}
    french = [r for p, _, r in test if r != num2words(int(p[0]["content"].split()[1]), lang="en")]
    assert len(french) == 50                                     # every other held-out pair still a one-digit change


def test_dpo_run_starts_at_log2_learns_and_its_reference_is_the_base(base, tmp_path):
    import transformers
    from safetensors.torch import load_file  # noqa: F401  (the checkpoint is read through trainer.json)
    run = tmp_path / "dpo"
    assert main(["finetune", "--model", str(base), "--out", str(run), *QUICK, "--set", "max_steps=30",
                 "--set", "eval_interval=15", "--set", "lr=2e-2", "--set", "dpo_beta=0.5"]) == 0
    evals = [r for r in metrics(run) if "pref_accuracy" in r]
    assert [r["step"] for r in evals] == [0, 15, 30]
    assert evals[0]["val_loss"] == pytest.approx(math.log(2), abs=1e-6)        # the policy is the reference
    assert evals[0]["reward_accuracy"] == 0.0                                   # every margin exactly 0
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 0.05
    state = json.loads(next((run / "ckpt").glob("step-*30/trainer.json")).read_text())
    ref = state["reference_logps"]
    assert len(ref["train"]) == 40 and len(ref["val"]) == 8
    # the reference of the first held-out pair, from transformers on the base
    tok = load_tokenizer(base)
    _, test = preference_task(40, 8, 99, seed=0)
    from tformer.training.finetune import load_pairs, FinetuneSettings
    s = FinetuneSettings.from_strings({"objective": "dpo", "n_train": "40", "n_test": "8", "max_number": "99",
                                       "max_length": "48"})
    _, val = load_pairs(s, tok, ChatTemplate(CHATML))
    hf = transformers.LlamaForCausalLM.from_pretrained(base).eval()
    for j, (ids, labels) in enumerate(val[0]):
        x = torch.tensor([ids[:-1]])
        y = torch.tensor(labels[1:])
        with torch.no_grad():
            lp = torch.log_softmax(hf(x).logits[0].float(), -1)
        keep = y != -100
        want = float(lp[keep].gather(-1, y[keep][:, None]).sum())
        assert ref["val"][0][j] == pytest.approx(want, abs=1e-4)


def test_resume_reads_the_reference_back_and_continues_exactly(base, tmp_path, monkeypatch):
    from tformer.training.tasks.preference import PreferenceTask
    common = [*QUICK, "--set", "eval_interval=3", "--set", "lr=1e-2", "--set", "log_interval=1"]
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert main(["finetune", "--model", str(base), "--out", str(whole), *common, "--set", "max_steps=6"]) == 0
    assert main(["finetune", "--model", str(base), "--out", str(part), *common, "--set", "max_steps=3"]) == 0

    def refuse(*a, **k):
        raise AssertionError("the reference was computed again on resume")
    monkeypatch.setattr(PreferenceTask, "compute_reference", refuse)
    assert main(["finetune", "--resume", "--out", str(part), "--set", "max_steps=6", "--set", "progress=false"]) == 0
    losses = lambda run: {r["step"]: r["loss"] for r in metrics(run) if "loss" in r}
    assert losses(part) == losses(whole) and sorted(losses(whole)) == [1, 2, 3, 4, 5, 6]
