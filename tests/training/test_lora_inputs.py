"""LoRA's inputs refused in one sentence (issue 49, items 14 and 15).

- ``lora_targets=gate_proj`` on a model whose MLP is not gated: the projections it has are named (it was an
  AttributeError from ``get_submodule``); ``all`` adapts every projection the model has.
- A malformed ``adapter_config.json``: a list, ``"r": "eight"``, ``"lora_dropout": "lots"``, a NaN
  ``lora_alpha`` (it loaded, and NaN logits followed), ``target_modules`` naming modules the model does not
  have (PEFT refuses such a folder; tformer ignored the field).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import char_checkpoint
from tformer import DecoderLM, TransformerConfig
from tformer.cli import main
from tformer.errors import CheckpointError, ConfigError
from tformer.training.lora import LoRASpec, add_lora, lora_modules, lora_sites
from tformer.training.peft_adapter import load_adapter, save_adapter


def decoder(ffn: str) -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(TransformerConfig(vocab_size=64, n_layers=2, d_model=32, n_heads=4, context_length=32, ffn=ffn))


def test_a_target_the_model_lacks_names_the_ones_it_has():
    with pytest.raises(ConfigError) as e:
        lora_sites(decoder("mlp"), ("q_proj", "gate_proj"))
    assert "gate_proj" in str(e.value) and "not gated" in str(e.value)
    assert "q_proj, k_proj, v_proj, o_proj, up_proj, down_proj" in str(e.value)
    assert len(lora_sites(decoder("swiglu"), ("gate_proj",))) == 2          # a gated MLP has one per block


def test_finetune_with_gate_proj_on_a_plain_mlp_is_one_line(tmp_path, capsys):
    base = char_checkpoint(tmp_path / "base")
    text = tmp_path / "t.txt"
    text.write_text("the cat sat on the mat. " * 80)
    argv = ["finetune", "--model", str(base), "--data", str(text), "--out", str(tmp_path / "run"),
            "--set", "max_steps=1", "--set", "progress=false", "--set", "threads=1"]
    assert main([*argv, "--set", "lora_targets=gate_proj"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "gate_proj" in err and "up_proj, down_proj" in err, err
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").glob("step-*"))


def test_all_targets_the_projections_the_model_has():
    from tformer.training.finetune import FinetuneSettings

    model = decoder("mlp")
    spec = FinetuneSettings(lora_targets="all").lora_spec(model)
    add_lora(model, spec)
    adapted = {name for m in lora_modules(model).values() for name in m.slices}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"}


@pytest.fixture
def adapter(tmp_path):
    model = add_lora(decoder("swiglu"), LoRASpec(r=2, targets=("q_proj", "v_proj")))
    save_adapter(model, tmp_path / "a")
    return tmp_path / "a"


def rewrite(folder, change):
    path = folder / "adapter_config.json"
    cfg = json.loads(path.read_text())
    path.write_text(change(cfg) if callable(change) else change)


@pytest.mark.parametrize("change, words", [
    ("[1, 2]", "holds a JSON list, not an object"),
    (lambda c: json.dumps({**c, "r": "eight"}), 'r="eight"; it must be a whole number'),
    (lambda c: json.dumps({**c, "r": 2.5}), "r=2.5; it must be a whole number"),
    (lambda c: json.dumps({**c, "r": 0}), "r=0; it must be a whole number of at least 1"),
    (lambda c: json.dumps({**c, "lora_dropout": "lots"}), 'lora_dropout="lots"; it must be a number in [0, 1)'),
    (lambda c: json.dumps({**c, "lora_alpha": math.nan}), "lora_alpha=NaN; it must be a finite number"),
    (lambda c: json.dumps({**c, "lora_alpha": "16"}), 'lora_alpha="16"'),
    (lambda c: json.dumps({**c, "target_modules": ["q_proj", "v_proj", "w_proj"]}),
     "names target_modules w_proj, which this model does not have"),
    (lambda c: json.dumps({**c, "target_modules": ".*\\.attn_c$"}), "matches no module of this model"),
    (lambda c: json.dumps({**c, "target_modules": "("}), "not a valid regular expression"),
])
def test_a_malformed_adapter_config_is_one_sentence(adapter, change, words):
    rewrite(adapter, change)
    with pytest.raises(CheckpointError) as e:
        load_adapter(decoder("swiglu"), adapter)
    assert words in str(e.value) and "adapter_config.json" in str(e.value), str(e.value)


def test_gate_proj_in_target_modules_of_a_plain_mlp_is_refused(tmp_path):
    model = add_lora(decoder("swiglu"), LoRASpec(r=2, targets=("q_proj", "gate_proj")))
    save_adapter(model, tmp_path)
    with pytest.raises(CheckpointError, match="gate_proj"):
        load_adapter(decoder("mlp"), tmp_path)


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], "all-linear", r"model\.layers\.\d+\.self_attn\.(q|v)_proj",
                                     ["self_attn.q_proj", "v_proj"]])
def test_well_formed_target_modules_load(adapter, targets):
    rewrite(adapter, lambda c: json.dumps({**c, "target_modules": targets}))
    model = load_adapter(decoder("swiglu"), adapter)
    assert {n for m in lora_modules(model).values() for n in m.slices} == {"q_proj", "v_proj"}
