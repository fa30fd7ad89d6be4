"""What is Gemma's alone, beyond the checks every family gets (test_families_hf.py, test_families_gguf.py):

- each config switch refuses a bad value in one sentence;
- a prompt longer than Gemma 3's window (512) equals transformers (angles in float64, 1e-4 of the logits'
  scale), and the window, the local RoPE base and Gemma 2's soft-caps each move the logits (so the checks can fail);
- a GGUF file of six Gemma 3 layers (the sixth global, as llama.cpp reads the file) equals transformers;
- a Gemma-style model built from tformer's own switches (as ``tformer train --set`` builds it) exports to a
  folder transformers loads with equal logits, and ``tformer train --set`` trains one;
- the whole-layer C++ call takes Gemma (its equality with the module path: tests/fused/test_families_fused.py), and
  the module path, token by token, equals recomputation.
"""

from __future__ import annotations

import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

import families as F  # noqa: E402

from tformer.config import TransformerConfig  # noqa: E402
from tformer.errors import ConfigError  # noqa: E402
from tformer.interop.hf import infer_model_type, load_hf, save_hf  # noqa: E402
from tformer.models import build_model  # noqa: E402

TOL = 1e-4
GEMMA = dict(vocab_size=96, context_length=64, n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, head_dim=32,
             positions="rope", norm="rmsnorm", norm_eps=1e-6, ffn="geglu", activation="gelu_tanh", bias=False,
             embedding_scale=True, norm_unit_offset=True, post_norms=True, attn_scale=32 ** -0.5, sliding_window=8,
             window_layers=[True, False])


@pytest.mark.parametrize("fields, words", [
    (dict(norm_unit_offset=1), "norm_unit_offset=1 must be true or false"),
    (dict(norm="layernorm", norm_unit_offset=True), "needs norm='rmsnorm'"),
    (dict(attn_scale=0), "attn_scale=0 must be a number > 0"),
    (dict(attn_softcap=-1.0), "attn_softcap=-1.0 must be a finite number >= 0"),
    (dict(post_norms=True, norm_placement="post"), "post_norms=true needs norm_placement='pre'"),
    (dict(ffn="geglu", activation="relu"), "ffn='geglu' gates with GELU"),
    (dict(window_layers=[True, 0], sliding_window=4), "must be a non-empty list of true/false"),
    (dict(window_layers=[True, False]), "window_layers needs sliding_window set"),
    (dict(rope_local_base=1e4, positions="rope"), "rope_local_base needs sliding_window set"),
    (dict(rope_local_base=-1.0, positions="rope", sliding_window=4), "must be a number > 0 with positions='rope'"),
])
def test_each_switch_refuses_a_bad_value_in_one_sentence(fields, words):
    with pytest.raises(ConfigError) as e:
        TransformerConfig(**{"vocab_size": 64, "n_heads": 2, "d_model": 32, "norm": "rmsnorm", **fields})
    message = str(e.value)
    assert words in message and "\n" not in message and message.endswith("."), message


@pytest.mark.parametrize("switch", [dict(attn_scale=0.1), dict(attn_softcap=50.0)])
def test_a_mixer_without_the_score_switches_refuses_them(switch):
    """Only mixer='attention' applies attn_scale and attn_softcap; another must not drop them silently."""
    with pytest.raises(ConfigError, match="mixer='performer' ignores attn_scale and attn_softcap"):
        build_model(TransformerConfig(vocab_size=64, n_heads=2, d_model=32, context_length=64, mixer="performer",
                                      **switch))


@pytest.fixture(scope="module", params=["gemma-2-2b", "gemma-3-270m"])
def pair(request, tmp_path_factory):
    family = request.param
    folder = F.hf_folder(family, tmp_path_factory.mktemp(family))
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    F.float64_angles(ref)
    return family, load_hf(folder), ref


def long_prompt(n: int = 600) -> torch.Tensor:
    return torch.randint(0, F.VOCAB - len(F.SPECIAL) - 1, (1, n), generator=torch.Generator().manual_seed(1))


def test_a_prompt_longer_than_the_window_equals_transformers(pair):
    family, ours, ref = pair
    x = long_prompt()
    with torch.no_grad():
        mine, theirs = ours(x)[0], ref(x).logits
        assert F.relative(mine, theirs) < TOL, family
        if ours.config.sliding_window < x.shape[1]:                 # Gemma 3's 512: the window acts here
            local = ours.blocks[0].attn
            local.window, saved = None, local.window
            try:
                assert F.relative(ours(x)[0], theirs) > 1e-3
            finally:
                local.window = saved


def test_the_gemma_switches_move_the_logits(pair):
    """Dropping the local RoPE base (Gemma 3) or the soft-caps (Gemma 2) changes the logits by more than the
    tolerance: the equality above holds them."""
    family, ours, ref = pair
    x = torch.tensor([F.prompts()[3]])
    attn = ours.blocks[0].attn
    with torch.no_grad():
        theirs = ref(x).logits
        if family.startswith("gemma-3"):
            attn.rope, saved = ours.rope, attn.rope
            try:
                assert F.relative(ours(x)[0], theirs) > 1e-3
            finally:
                attn.rope = saved
        else:
            attn.softcap = 0.0
            try:
                assert F.relative(ours(x)[0], theirs) > 1e-3
            finally:
                attn.softcap = ours.config.attn_softcap
            ours.config.logit_softcap = 0.0
            try:
                assert F.relative(ours(x)[0], theirs) > 1e-3
            finally:
                ours.config.logit_softcap = ref.config.final_logit_softcapping


def test_six_gemma3_layers_from_gguf_equal_transformers(tmp_path, monkeypatch):
    """Six layers: the sixth is global (RoPE base 1,000,000) as llama.cpp reads a gemma3 file."""
    pytest.importorskip("gguf")
    from tformer.interop.gguf_import import load_gguf

    monkeypatch.setattr(F, "N_LAYERS", 6)
    ref = F.hf_model("gemma-3-270m", gguf_layout=True)
    path = F.write_gguf("gemma-3-270m", ref, tmp_path / "six.gguf", "f32")
    F.float64_angles(ref)
    model = load_gguf(path)
    assert [model.config.windowed(i) for i in range(6)] == [t == "sliding_attention" for t in ref.config.layer_types]
    assert model.config.rope_local_base == 10000.0 and model.config.rope_base == 1e6
    with torch.no_grad():
        for ids in F.prompts()[1:]:
            x = torch.tensor([ids])
            assert F.relative(model(x)[0], ref(x).logits) < TOL, len(ids)


@pytest.mark.parametrize("extra, model_type", [
    (dict(attn_softcap=50.0, logit_softcap=30.0), "gemma2"),
    (dict(qk_norm=True, qk_norm_gain=True, rope_base=1e6, rope_local_base=1e4), "gemma3_text"),
])
def test_a_model_built_from_the_switches_exports_to_transformers(tmp_path, extra, model_type):
    torch.manual_seed(0)
    model = build_model(TransformerConfig(**GEMMA, **extra)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)                         # the (1 + w) gains away from their zero start
    assert infer_model_type(model.config) == model_type
    save_hf(model, tmp_path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    x = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(2))   # past the window of 8
    with torch.no_grad():
        assert F.relative(model(x)[0], ref(x).logits) < TOL


def test_tformer_train_builds_and_trains_a_gemma_style_model(tmp_path, capsys):
    from tformer.checkpoint import load_model
    from tformer.cli import main

    rng = random.Random(0)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(rng.choice(["the", "cat", "sat", "on", "a", "mat"]) for _ in range(20_000)) + "\n")
    sets = ["progress=false", "threads=1", f"cache_dir={tmp_path / 'cache'}", "sample_tokens=0", "context_length=32",
            "max_steps=2", "eval_interval=2", "eval_batches=1", "n_layers=2", "positions=rope", "norm=rmsnorm",
            "ffn=geglu", "activation=gelu_tanh", "embedding_scale=true", "norm_unit_offset=true", "post_norms=true",
            "attn_softcap=50", "logit_softcap=30", "sliding_window=8", "window_layers=[true, false]",
            "rope_local_base=10000", "qk_norm=true", "qk_norm_gain=true", "attn_scale=0.1"]
    assert main(["train", "--data", str(corpus), "--out", str(tmp_path / "run"),
                 *[a for s in sets for a in ("--set", s)]]) == 0
    model = load_model(tmp_path / "run")
    c = model.config
    assert (c.ffn, c.post_norms, c.window_layers, c.rope_local_base, c.attn_softcap) == (
        "geglu", True, [True, False], 10000.0, 50.0)
    assert model.blocks[0].attn_post_norm is not None and model.local_rope is not None


def test_the_whole_layer_call_takes_gemma_and_the_module_path_is_exact(pair):
    import copy

    import tformer.fused as whole
    from tformer.generation.step import decode_step, prefill
    from tformer.quant.quantize import set_precision

    family, ours, _ = pair
    assert "DecodeLinear" in whole.chosen(ours).reason             # torch's Linear layers: the module path
    plan = whole.chosen(set_precision(copy.deepcopy(ours), "fp32")).plan
    assert plan is not None and plan.windows and ours.config.logit_softcap == (30.0 if family == "gemma-2-2b" else 0.0)
    ids = torch.tensor([F.prompts()[2]])
    with torch.no_grad():                                           # the module path, token by token: exact
        full = ours(ids)[0][0]
        state = ours.new_state(1, ids.shape[1])
        steps = [prefill(ours, ids[:, :5], state)[0]]
        steps += [decode_step(ours, ids[:, t:t + 1], state)[0] for t in range(5, ids.shape[1])]
    assert F.relative(torch.stack(steps), full[4:]) < 1e-5


@pytest.mark.parametrize("switch", [dict(norm_unit_offset=True), dict(post_norms=True), dict(attn_softcap=50.0),
                                    dict(attn_scale=0.1), dict(sliding_window=8, window_layers=[True, False])])
def test_a_llama_with_a_gemma_switch_is_refused_on_export(tmp_path, switch):
    """Llama has no name for these: save_hf and the GGUF exporter refuse them, naming the field."""
    from tformer.interop.gguf import save_gguf

    fields = dict(vocab_size=64, context_length=32, n_layers=2, d_model=32, n_heads=2, positions="rope",
                  norm="rmsnorm", ffn="swiglu", bias=False, **switch)
    model = build_model(TransformerConfig(**fields))
    name = next(iter(switch)) if "window_layers" not in switch else "window_layers"
    for export in (lambda: save_hf(model, tmp_path / "hf", "llama"),
                   lambda: save_gguf(model, tmp_path / "m.gguf", "f32", "llama")):
        with pytest.raises(ConfigError, match=name):
            export()
