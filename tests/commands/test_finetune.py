"""``tformer finetune`` end to end on a random-initialised small Llama (HF folder): LoRA and full runs
on the one loop, the adapter PEFT loads, --merge, chat masking, bad lines, and exact resume after kill -9."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("num2words")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
from finetune_fixtures import tiny_llama  # noqa: E402

from tformer.checkpoint import load_model  # noqa: E402
from tformer.cli import main  # noqa: E402
from tformer.interop.hf import load_hf  # noqa: E402
from tformer.tokenizers import load_tokenizer  # noqa: E402
from tformer.training.chat_data import CHATML, ChatTemplate, chat_example  # noqa: E402
from tformer.training.peft_adapter import load_adapter  # noqa: E402

SRC = str(Path(__file__).resolve().parents[2] / "src")
QUICK = ["--set", "n_train=200", "--set", "n_test=16", "--set", "eval_exact=8", "--set", "progress=false",
         "--set", "threads=1", "--set", "batch_size=4", "--set", "max_length=48"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("base"))


def finetune(*args):
    return main(["finetune", *args, *QUICK])


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_lora_run_learns_and_its_adapter_loads_in_peft(base, tmp_path, capsys):
    import transformers
    run = tmp_path / "run"
    assert finetune("--model", str(base), "--out", str(run), "--merge", "--set", "max_steps=40",
                    "--set", "eval_interval=20", "--set", "lr=2e-2") == 0
    vals = [r["val_loss"] for r in metrics(run) if "val_loss" in r]
    assert len(vals) == 3 and vals[-1] < vals[0] - 0.2, vals            # the answers' loss falls
    assert "exact match" in capsys.readouterr().out
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(0))
    ours = load_adapter(load_hf(base), run / "adapter").eval()
    ref = peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM.from_pretrained(base), run / "adapter").eval()
    with torch.no_grad():
        a, b, m = ours(ids)[0], ref(ids).logits, load_model(run / "merged").eval()(ids)[0]
        plain = load_hf(base)(ids)[0]
    assert (a - b).abs().max() < 1e-5 and (m - a).abs().max() < 1e-5
    assert (plain - a).abs().max() > 1e-3                                 # the adapter learnt something
    assert (run / "merged" / "chat_template.jinja").read_text() == CHATML


def test_full_run_trains_every_weight(base, tmp_path, capsys):
    run = tmp_path / "run"
    assert finetune("--model", str(base), "--out", str(run), "--method", "full", "--set", "max_steps=4",
                    "--set", "eval_interval=4") == 0
    n = sum(p.numel() for p in load_hf(base).parameters())
    assert f"full: {n:,} of {n:,} parameters trained" in capsys.readouterr().out
    after, before = load_model(run / "merged").state_dict(), load_hf(base).state_dict()
    assert all(not torch.equal(after[k], before[k]) for k in before)
    assert not (run / "adapter").exists()


def test_chat_masking_trains_the_answers_only(base):
    tok = load_tokenizer(base / "tokenizer.json")
    conv = [{"role": "system", "content": "Be short."}, {"role": "user", "content": "Write 12 in French words."},
            {"role": "assistant", "content": "douze"}, {"role": "user", "content": "And 3?"},
            {"role": "assistant", "content": "trois"}]
    ids, labels = chat_example(conv, ChatTemplate(), tok)
    assert tok.tok.decode(ids, skip_special_tokens=False) == ChatTemplate().render(conv)              # the whole conversation, once
    kept = [i for i, l in zip(ids, labels) if l != -100]
    assert [l for l in labels if l != -100] == kept
    assert tok.tok.decode(kept, skip_special_tokens=False) == "douze<|im_end|>\ntrois<|im_end|>\n"


def test_a_chat_file_trains_and_a_bad_line_is_named(base, tmp_path, capsys):
    good = tmp_path / "chats.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"Say {i}."}, {"role": "assistant", "content": str(i)}]}
            for i in range(20)]
    good.write_text("\n".join(map(json.dumps, rows)) + "\n\n")
    assert finetune("--model", str(base), "--data", str(good), "--out", str(tmp_path / "a"),
                    "--set", "max_steps=2", "--set", "eval_interval=2") == 0
    capsys.readouterr()
    for n, line in ((3, "{not json"), (2, json.dumps({"messages": [{"role": "user", "content": "hi"}]})),
                    (4, json.dumps({"messages": [{"role": "robot", "content": "x"}]}))):
        bad = tmp_path / f"bad{n}.jsonl"
        lines = [json.dumps(r) for r in rows[:5]]
        lines[n - 1] = line
        bad.write_text("\n".join(lines) + "\n")
        assert finetune("--model", str(base), "--data", str(bad), "--out", str(tmp_path / f"b{n}")) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"line {n}" in err and "Traceback" not in err, err


def test_plain_text_trains(base, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("quatre mille trois cent soixante-douze. " * 60)
    assert finetune("--model", str(base), "--data", str(text), "--out", str(tmp_path / "r"),
                    "--set", "max_steps=3", "--set", "eval_interval=3") == 0
    assert metrics(tmp_path / "r")[-1]["step"] == 3


def adapter_and_optimizer(run: Path) -> tuple[dict, dict]:
    from safetensors.torch import load_file
    ckpt = run / json.loads((run / "checkpoint.json").read_text())["latest"]
    weights = {k: v for k, v in load_file(str(ckpt / "model.safetensors")).items() if "lora_" in k}
    return weights, torch.load(ckpt / "optimizer.pt", weights_only=True)["optimizer"]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])     # bf16: the frozen base's cached casts (frozen_cast.py)
def test_resume_after_kill_9_is_exact(base, tmp_path, precision):
    run = tmp_path / "killed"
    common = ["--model", str(base), "--set", "eval_interval=3", "--set", "decay_steps=60", "--set", "lora_dropout=0.1",
              "--set", f"precision={precision}"]
    env = {**os.environ, "PYTHONPATH": SRC}
    proc = subprocess.Popen([sys.executable, "-m", "tformer", "finetune", "--out", str(run), *common, *QUICK,
                             "--set", "max_steps=100000"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 120
        while not (run / "checkpoint.json").is_file() or json.loads((run / "checkpoint.json").read_text())["step"] < 3:
            assert proc.poll() is None and time.time() < deadline, proc.stderr.read().decode()[-2000:]
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        proc.kill()
    step = json.loads((run / "checkpoint.json").read_text())["step"]
    total = step + 6
    assert finetune("--resume", "--out", str(run), "--set", f"max_steps={total}") == 0
    straight = tmp_path / "straight"
    assert finetune("--out", str(straight), *common, "--set", f"max_steps={total}") == 0
    (wa, oa), (wb, ob) = adapter_and_optimizer(run), adapter_and_optimizer(straight)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert oa["state"].keys() == ob["state"].keys() and len(oa["state"]) == 2 * 2 * 2
    for k in oa["state"]:
        assert all(torch.equal(oa["state"][k][n], ob["state"][k][n]) for n in oa["state"][k])
    assert [r["loss"] for r in metrics(run) if r.get("step", 0) > step and "loss" in r] == \
           [r["loss"] for r in metrics(straight) if r.get("step", 0) > step and "loss" in r]


def test_settings_are_checked_up_front(base, tmp_path, capsys):
    for args, needle in ((["--set", "lora_targets=q,v"], "not known"), (["--set", "lora_r=0"], "lora_r=0"),
                         (["--set", "nope=1"], "unknown setting 'nope'"), ([], "needs --model")):
        model = [] if needle == "needs --model" else ["--model", str(base)]
        assert finetune(*model, "--out", str(tmp_path / "x"), *args) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err, err
