"""HF MambaForCausalLM <-> tformer: logits equal to transformers' (1e-4) at several shapes, both
directions; greedy generation token-identical to HF generate; configs HF cannot express refused."""

from __future__ import annotations

import pytest
import torch

from tformer.config import TransformerConfig
from tformer.interop.hf import load_hf, save_hf

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

SHAPES = {
    "default": dict(),
    "small-state-rank5-k4": dict(state_size=4, expand=1, conv_kernel=4, time_step_rank=5),
    "wide-k2-rank1-bias": dict(state_size=16, expand=3, conv_kernel=2, time_step_rank=1, use_bias=True,
                               use_conv_bias=False),
    "untied": dict(tie_word_embeddings=False),
}


def hf_model(seed=0, **kw):
    torch.manual_seed(seed)
    config = transformers.MambaConfig(**{**dict(vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=2,
                                                expand=2, conv_kernel=3, time_step_rank="auto"), **kw})
    return transformers.MambaForCausalLM(config).eval()


@pytest.mark.parametrize("name", list(SHAPES))
def test_import_logits_equal_transformers(tmp_path, name):
    hf = hf_model(**SHAPES[name])
    hf.save_pretrained(tmp_path)
    ours = load_hf(tmp_path)
    assert ours.config.mixer == "mamba" and ours.config.ffn == "none"
    ids = torch.randint(0, 64, (2, 19))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids)[0], hf(ids).logits, atol=1e-4, rtol=1e-4)


def test_export_loads_in_transformers_with_equal_logits(tmp_path):
    hf = hf_model(**SHAPES["wide-k2-rank1-bias"])
    hf.save_pretrained(tmp_path / "hf")
    ours = load_hf(tmp_path / "hf")
    save_hf(ours, tmp_path / "back")
    again = transformers.MambaForCausalLM.from_pretrained(tmp_path / "back").eval()
    ids = torch.randint(0, 64, (2, 13))
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, ours(ids)[0], atol=1e-4, rtol=1e-4)
    for k, v in hf.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k


def test_native_model_exports(tmp_path):
    from tformer.models import build_model
    config = TransformerConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=1, mixer="mamba", ffn="none",
                               positions="none", norm="rmsnorm", bias=False,
                               mixer_options={"mamba": dict(d_state=4, dt_rank=3)})
    torch.manual_seed(0)
    ours = build_model(config).eval()
    save_hf(ours, tmp_path)
    theirs = transformers.MambaForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 64, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids)[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bad", [dict(ffn="mlp"), dict(norm="layernorm"), dict(selective=False)])
def test_export_refuses_what_hf_mamba_cannot_express(tmp_path, bad):
    from tformer.models import build_model
    options = {"selective": bad.pop("selective")} if "selective" in bad else {}
    config = TransformerConfig(**{**dict(vocab_size=64, d_model=32, n_layers=1, n_heads=1, mixer="mamba", ffn="none",
                                         positions="none", norm="rmsnorm", bias=False,
                                         mixer_options={"mamba": options}), **bad})
    with pytest.raises(ValueError, match="cannot export as mamba"):
        save_hf(build_model(config), tmp_path, model_type="mamba")


# ------------------------------------------------------------------ generation through the generic path
def tformer_mamba(seed=0, **options):
    from tformer.models import build_model
    config = TransformerConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=1, mixer="mamba", ffn="none",
                               positions="none", norm="rmsnorm", bias=False, context_length=256,
                               mixer_options={"mamba": {"d_conv": 4, **options}})
    torch.manual_seed(seed)
    return build_model(config).eval()


def test_state_prefill_and_steps_equal_the_full_forward():
    model = tformer_mamba()
    ids = torch.randint(0, 64, (2, 15))
    with torch.no_grad():
        full, _ = model(ids)
        state = model.new_state(2, 15)
        parts = [model(ids[:, :6], state=state)[0]]
        parts += [model(ids[:, t:t + 1], state=state)[0] for t in range(6, 15)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)
    assert state.nbytes == 2 * 2 * 64 * (3 + 16) * 4       # batch 2, 2 layers, E=64, K-1=3, N=16, fp32


@pytest.mark.parametrize("static", [False, True])
def test_cached_generation_equals_recomputation(static):
    from tformer.generation.generate import generate
    model = tformer_mamba(seed=1)
    ids = torch.randint(0, 64, (2, 7))
    with_state = generate(model, ids, 24, temperature=0, static=static)
    recomputed = generate(model, ids, 24, temperature=0, use_cache=False)
    assert torch.equal(with_state, recomputed)


def test_batched_left_padding_equals_each_prompt_alone():
    from tformer.generation.generate import generate
    model = tformer_mamba(seed=2)
    model.blocks[0].attn.in_proj.bias = torch.nn.Parameter(torch.randn(128))  # padding is zeroed after the bias
    prompts = [torch.randint(0, 64, (n,)) for n in (3, 9, 6)]
    ids = torch.zeros(3, 9, dtype=torch.long)
    mask = torch.zeros(3, 9, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, 9 - len(p):], mask[i, 9 - len(p):] = p, 1
    batched = generate(model, ids, 12, temperature=0, attention_mask=mask)
    for i, p in enumerate(prompts):
        alone = generate(model, p[None], 12, temperature=0)
        assert torch.equal(batched[i, 9:], alone[0, len(p):]), i
    with torch.no_grad():  # and the logits, not only the argmax
        alone, _ = model(prompts[0][None])
        padded, _ = model(ids[:1], attention_mask=mask[:1])
    torch.testing.assert_close(padded[:, 6:], alone, atol=1e-5, rtol=1e-5)


def test_greedy_generation_token_identical_to_transformers(tmp_path):
    from tformer.generation.generate import generate
    hf = hf_model(seed=3, num_hidden_layers=3)
    hf.save_pretrained(tmp_path)
    ours = load_hf(tmp_path)
    ids = torch.randint(1, 64, (2, 8))
    theirs = hf.generate(ids, max_new_tokens=30, do_sample=False, min_new_tokens=30, pad_token_id=0)
    assert torch.equal(generate(ours, ids, 30, temperature=0), theirs)


# ------------------------------------------------------------------ accounting of whole models
def test_mamba_130m_preset_counts_what_transformers_builds():
    from tformer.accounting import count_parameters, state_bytes
    from tformer.models import build_model
    c = TransformerConfig.from_name("mamba-130m")
    with torch.device("meta"):
        theirs = transformers.MambaForCausalLM(transformers.MambaConfig(
            vocab_size=50280, hidden_size=768, num_hidden_layers=24, state_size=16, expand=2, conv_kernel=4))
        ours = build_model(c)
    n_theirs = sum(p.numel() for p in theirs.parameters())
    assert count_parameters(c).total == ours.num_parameters() == n_theirs
    # the state is E·(K-1+N) per layer at any length; the KV cache of an equal-size transformer grows
    gpt = TransformerConfig.from_name("gpt2-124m")
    assert state_bytes(c, 64, 1, 2) == state_bytes(c, 1 << 16, 1, 2) == 24 * 1536 * (3 + 16) * 2
    assert state_bytes(gpt, 8192, 1, 2) == 2 * 12 * 8192 * 768 * 2


def test_hybrid_stack_counts_and_generates():
    from tformer.accounting import count_parameters, state_bytes
    from tformer.generation.generate import generate
    from tformer.models import build_model
    c = TransformerConfig(vocab_size=64, d_model=32, n_layers=4, n_heads=2, mixer=["mamba", "attention"],
                          positions="rope", norm="rmsnorm", bias=False, ffn="swiglu", context_length=64)
    torch.manual_seed(0)
    model = build_model(c).eval()
    assert count_parameters(c).total == model.num_parameters()
    state = model.new_state(1, 40)
    assert state.nbytes == state_bytes(c, 40, 1, 4)
    ids = torch.randint(0, 64, (1, 5))
    assert torch.equal(generate(model, ids, 20, temperature=0), generate(model, ids, 20, temperature=0, use_cache=False))


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_lower_precision_mamba_stays_close(precision):
    """int8 keeps layers whose in_features the kernel cannot take (dt_proj: in = dt_rank) in float."""
    from tformer.quant.quantize import set_precision
    model = tformer_mamba(seed=4)
    ids = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        ref = model(ids)[0]
        low = set_precision(tformer_mamba(seed=4), precision)(ids)[0].float()
    assert torch.isfinite(low).all()
    assert (low - ref).abs().max() < 0.05 * ref.abs().max()
