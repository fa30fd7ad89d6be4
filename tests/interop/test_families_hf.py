"""Llama 3.x (llama3-scaled RoPE), Qwen3 (QK-norm gains, head_dim 128), Qwen2.5 (YaRN), Gemma 2 and Gemma 3 from HF
folders, against transformers (the fixtures: :mod:`families`, each at its published configuration cut to 2 layers).

Reference: transformers' own model of the folder, its RoPE angles computed in float64 from its own
frequency formula (:func:`families.float64_angles`; transformers computes them in float32, off by ~1e-3
radians at 10^4 positions). Tolerance 1e-4 relative to the logits' scale. The prompt past
``original_max_position_embeddings`` is :func:`families.far_positions`: six tokens at 0..5, six more
after the original context, so the last ones attend across more than it.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import families as F  # noqa: E402

from tformer.accounting import count_parameters  # noqa: E402
from tformer.generation.generate import generate  # noqa: E402
from tformer.generation.step import decode_step, prefill  # noqa: E402
from tformer.interop.hf import load_hf, save_hf  # noqa: E402
from tformer.interp.hooks import hook_names, run_with_cache  # noqa: E402

TOL = 1e-4
FAMILIES = list(F.PUBLISHED)


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    """(family, folder, tformer model, transformers model with float64 angles)."""
    family = request.param
    folder = F.hf_folder(family, tmp_path_factory.mktemp(family))
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    F.float64_angles(ref)
    yield family, folder, load_hf(folder), ref


def far_prompt(model) -> tuple[torch.Tensor, torch.Tensor]:
    scaling = model.config.rope_scaling or {}
    pos = F.far_positions(scaling.get("original_max_position_embeddings", 8192))
    ids = torch.tensor([F.prompts()[3][:len(pos)]])
    return ids, pos[None]


def test_config_is_the_published_one(pair):
    family, folder, ours, ref = pair
    hf = json.loads((folder / "config.json").read_text())
    c = ours.config
    assert (c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff, c.tie_embeddings) == (
        hf["hidden_size"], hf["num_attention_heads"], hf["num_key_value_heads"], ref.model.layers[0].self_attn.head_dim,
        hf["intermediate_size"], hf["tie_word_embeddings"])
    rope = hf["rope_parameters"].get("full_attention", hf["rope_parameters"])     # Gemma 3: the global layers'
    assert c.rope_base == rope["rope_theta"]
    scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "type")
               and (k, v) != ("partial_rotary_factor", 1.0)}                    # Phi3Config writes the whole-head 1.0
    assert (c.rope_scaling or {"rope_type": "default"}) == scaling
    assert c.qk_norm_gain == (family.startswith(("qwen3", "gemma-3")))
    if family.startswith("phi"):
        assert c.sliding_window is None                 # Phi-3.5's 262,144 exceeds its 131,072 positions


def test_logits_equal_transformers_on_five_prompts(pair):
    family, _, ours, ref = pair
    with torch.no_grad():
        for ids in F.prompts():
            x = torch.tensor([ids])
            assert F.relative(ours(x)[0], ref(x).logits) < TOL, (family, len(ids))
        ids, pos = far_prompt(ours)
        assert F.relative(ours(ids, positions=pos)[0], ref(ids, position_ids=pos).logits) < TOL, family


def test_the_far_prompt_sees_the_scaling(pair):
    """The far prompt's logits move when the scaling is dropped (so the check above can fail)."""
    family, folder, ours, ref = pair
    if ours.config.rope_scaling is None:
        pytest.skip("plain RoPE")
    ids, pos = far_prompt(ours)
    ref.model.rotary_emb.rope_type = "default"
    F.float64_angles(ref)
    try:
        with torch.no_grad():
            assert F.relative(ours(ids, positions=pos)[0], ref(ids, position_ids=pos).logits) > 1e-3
    finally:
        ref.model.rotary_emb.rope_type = ref.config.rope_parameters["rope_type"]
        F.float64_angles(ref)


def test_32_greedy_tokens_equal_transformers(pair):
    family, _, ours, ref = pair
    ids = torch.tensor([F.prompts()[2]])
    with torch.no_grad():
        theirs = ref.generate(ids, max_new_tokens=32, do_sample=False, min_new_tokens=32, eos_token_id=None,
                              pad_token_id=0)
    mine = generate(ours, ids, 32, temperature=0.0)
    assert mine[0, ids.shape[1]:].tolist() == theirs[0, ids.shape[1]:].tolist(), family


def test_cached_decoding_equals_recomputation(pair):
    family, _, ours, _ = pair
    ids = torch.tensor([F.prompts()[2]])
    with torch.no_grad():
        full = ours(ids)[0][0]                                                       # (T, vocab)
        state = ours.new_state(1, ids.shape[1])
        logits = [prefill(ours, ids[:, :20], state)[0]]
        for t in range(20, ids.shape[1]):
            logits.append(decode_step(ours, ids[:, t:t + 1], state)[0])
    assert F.relative(torch.stack(logits), full[19:]) < 1e-5, family


def test_save_hf_loads_in_transformers_with_equal_logits(pair, tmp_path):
    family, folder, ours, ref = pair
    save_hf(ours, tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(back) is type(ref)
    legacy = ("type",)                                  # the old name of rope_type, which Phi-3.5's config still carries
    assert {k: v for k, v in back.config.rope_parameters.items() if k not in legacy} == \
        {k: v for k, v in ref.config.rope_parameters.items() if k not in legacy}
    F.float64_angles(back)
    x = torch.tensor([F.prompts()[2]])
    with torch.no_grad():
        assert F.relative(back(x).logits, ref(x).logits) < 1e-6, family


def test_count_equals_the_built_model(pair):
    _, _, ours, _ = pair
    assert count_parameters(ours.config).total == ours.num_parameters()


def test_run_with_cache_gives_transformer_lens_names(pair):
    _, _, ours, _ = pair
    x = torch.tensor([F.prompts()[1]])
    logits, cache = run_with_cache(ours, x)
    for name in ("hook_embed", "blocks.0.hook_resid_pre", "blocks.0.attn.hook_q", "blocks.0.attn.hook_rot_k",
                 "blocks.1.attn.hook_pattern", "blocks.1.hook_resid_post", "ln_final.hook_out"):
        assert name in hook_names(ours) and name in cache.keys(), name
    with torch.no_grad():
        assert F.relative(logits, ours(x)[0]) < 1e-5


def test_lora_steps_and_the_peft_adapter_loads_in_peft(pair, tmp_path):
    """A few LoRA steps on every projection; the adapter saved in PEFT's format gives, in peft on
    transformers' model of the same folder, the logits tformer gives (1e-4 of their scale)."""
    peft = pytest.importorskip("peft")
    from tformer.training.lora import LoRASpec, add_lora, lora_parameters
    from tformer.training.peft_adapter import save_adapter

    family, folder, _, _ = pair
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    model = add_lora(load_hf(folder), LoRASpec(r=4, alpha=8, targets=targets)).train()
    opt = torch.optim.AdamW(lora_parameters(model).values(), lr=1e-2)
    ids = torch.tensor([F.prompts()[3][:64]])
    losses = []
    for _ in range(3):
        _, loss = model(ids[:, :-1], ids[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < losses[0], losses
    model.eval()
    save_adapter(model, tmp_path / "adapter", base_model=str(folder))
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ref = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    F.float64_angles(ref.base_model.model)
    x = torch.tensor([F.prompts()[2]])
    with torch.no_grad():
        ours, theirs = model(x)[0], ref(x).logits
        assert F.relative(ours, theirs) < TOL, family
        assert F.relative(load_hf(folder)(x)[0], theirs) > 1e-3          # the adapter matters


def test_qwen3_with_qkv_biases_only_is_refused(tmp_path):
    """Qwen3's attention_bias puts a bias on o_proj too, so tformer's q/k/v-only biases have no Qwen3 name."""
    from tformer.config import TransformerConfig
    from tformer.errors import ConfigError
    from tformer.models import build_model

    c = TransformerConfig(vocab_size=64, context_length=32, n_layers=1, d_model=32, n_heads=2, positions="rope",
                          norm="rmsnorm", ffn="swiglu", bias=False, qkv_bias=True, qk_norm=True, qk_norm_gain=True)
    with pytest.raises(ConfigError, match="qkv_bias"):
        save_hf(build_model(c), tmp_path, "qwen3")


@pytest.mark.parametrize("rslora", [False, True])
def test_phi3_fused_peft_adapter_on_some_parts_equals_peft(tmp_path, rslora):
    """Phi-3's fused qkv_proj / gate_up_proj with only some parts adapted (q and v: zero rows for k; up only) and
    rsLoRA's sqrt(k) alpha: the adapter tformer writes (training/peft_fused.py) gives, in peft, tformer's logits."""
    peft = pytest.importorskip("peft")
    from tformer.training.lora import LoRASpec, add_lora, lora_parameters
    from tformer.training.peft_adapter import save_adapter

    torch.manual_seed(0)
    hf = transformers.Phi3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                 pad_token_id=None, bos_token_id=None, eos_token_id=None)
    transformers.Phi3ForCausalLM(hf).save_pretrained(tmp_path / "base")
    spec = LoRASpec(r=2, alpha=6, targets=("q_proj", "v_proj", "up_proj", "down_proj"), rslora=rslora)
    model = add_lora(load_hf(tmp_path / "base"), spec).eval()
    for name, p in lora_parameters(model).items():
        torch.nn.init.normal_(p.data, std=0.3)                      # B too: the adapter matters
    save_adapter(model, tmp_path / "adapter", base_model=str(tmp_path / "base"))
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    ref = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    x = torch.randint(0, 64, (1, 12))
    with torch.no_grad():
        ours, theirs = model(x)[0], ref(x).logits
        assert F.relative(ours, theirs) < TOL
        assert F.relative(load_hf(tmp_path / "base")(x)[0], theirs) > 1e-3
