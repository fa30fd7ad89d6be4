"""LoRA against PEFT (the independent reference): adapters written by one load in the other with
logits equal within 1e-5, merging keeps the logits, and training touches the adapters only."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tformer.errors import CheckpointError, ConfigError  # noqa: E402
from tformer.interop.hf import load_hf  # noqa: E402
from tformer.training.lora import LoRASpec, add_lora, lora_modules, lora_parameters, merge_lora  # noqa: E402
from tformer.training.peft_adapter import load_adapter, read_adapter, save_adapter  # noqa: E402

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A random-initialised small Llama (GQA: 4 query heads, 2 key/value heads), saved as HF does."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    folder = tmp_path_factory.mktemp("llama")
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(folder)
    return folder


def hf_model(folder):
    return transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


IDS = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(1))


def tformer_logits(model):
    with torch.no_grad():
        return model.eval()(IDS)[0]


def hf_logits(model):
    with torch.no_grad():
        return model(IDS).logits


def randomise(model):
    """Non-zero B matrices (a fresh adapter is exactly the base model, which would test nothing)."""
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in lora_parameters(model).values():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("targets", [("q_proj", "v_proj"), ALL])
def test_peft_adapter_loads_in_tformer(llama, tmp_path, targets):
    torch.manual_seed(3)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), init_lora_weights=False,
                          task_type="CAUSAL_LM")
    ref = peft.get_peft_model(hf_model(llama), cfg).eval()
    ref.save_pretrained(tmp_path)
    model = load_adapter(load_hf(llama), tmp_path)
    assert sorted(model.lora_spec.targets) == sorted(targets)
    assert (tformer_logits(model) - hf_logits(ref)).abs().max() < 1e-5
    assert (tformer_logits(load_hf(llama)) - hf_logits(ref)).abs().max() > 1e-3   # the adapter matters


@pytest.mark.parametrize("targets,rslora", [(("q_proj", "v_proj"), False), (ALL, True)])
def test_tformer_adapter_loads_in_peft(llama, tmp_path, targets, rslora):
    model = add_lora(load_hf(llama), LoRASpec(r=4, alpha=8, dropout=0.1, targets=targets, rslora=rslora))
    randomise(model)
    save_adapter(model, tmp_path, base_model=str(llama))
    ref = peft.PeftModel.from_pretrained(hf_model(llama), tmp_path).eval()
    assert (tformer_logits(model) - hf_logits(ref)).abs().max() < 1e-5
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8 and sorted(cfg["target_modules"]) == sorted(targets)


def test_fresh_adapter_is_the_base_model(llama):
    base = tformer_logits(load_hf(llama))
    assert torch.equal(tformer_logits(add_lora(load_hf(llama), LoRASpec())), base)


def test_merge_equals_base_plus_adapter(llama):
    model = add_lora(load_hf(llama), LoRASpec(r=4, alpha=8, targets=ALL))
    randomise(model)
    before = tformer_logits(model)
    merged = merge_lora(model)
    assert not lora_modules(merged) and not lora_parameters(merged)
    assert set(merged.state_dict()) == set(load_hf(llama).state_dict())     # the base architecture again
    assert (tformer_logits(merged) - before).abs().max() < 1e-5
    assert (tformer_logits(load_hf(llama)) - before).abs().max() > 1e-3


def test_only_lora_parameters_train(llama):
    model = add_lora(load_hf(llama), LoRASpec(r=4, alpha=8)).train()
    base = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(lora_parameters(model)) and len(trainable) == 2 * 2 * 2   # 2 layers · q,v · A,B
    a0 = {n: p.detach().clone() for n, p in lora_parameters(model).items() if ".lora_A." in n}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        _, loss = model(IDS, IDS)
        loss.backward()
        assert all(p.grad is None for n, p in model.named_parameters() if n not in trainable)
        assert all(model.get_parameter(n).grad.abs().sum() > 0 for n in trainable if ".lora_B." in n)
        opt.step()
        opt.zero_grad()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in base.items())
    assert all(model.get_parameter(n).grad is None for n in trainable)
    assert all(not torch.equal(a, model.get_parameter(n)) for n, a in a0.items())   # A learns once B != 0


def test_bad_settings_and_adapters(llama, tmp_path):
    with pytest.raises(ConfigError, match="not known"):
        LoRASpec(targets=("q", "v"))
    with pytest.raises(ConfigError, match="at least 1"):
        LoRASpec(r=0)
    with pytest.raises(CheckpointError, match="not a PEFT adapter folder"):
        read_adapter(tmp_path)
    model = add_lora(load_hf(llama), LoRASpec(r=2))
    save_adapter(model, tmp_path)
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(CheckpointError, match="use_dora"):
        read_adapter(tmp_path)
