"""The HF family registry: a new family is one module in ``tformer/interop/`` plus its name in
``hf.FAMILY_MODULES``, and ``hf.py`` itself names no family.

References: the modules found on disk (every one that defines ``MODEL_TYPES``), ``hf.py``'s own
syntax tree, and for inference a table of configs written out by hand with the family each one is.
"""

import ast
import importlib
import tempfile
from pathlib import Path

import pytest

from tformer.config import TransformerConfig
from tformer.errors import ConfigError
from tformer.interop import hf
from tformer.models import build_model

INTEROP = Path(hf.__file__).parent


def _family_modules_on_disk() -> set[str]:
    found = set()
    for path in INTEROP.glob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if any(isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "MODEL_TYPES" for t in node.targets)
               for node in tree.body):
            found.add(path.stem)
    return found


def test_every_family_module_is_registered_and_has_the_protocol():
    assert _family_modules_on_disk() == set(hf.FAMILY_MODULES)
    types = [t for module in hf.MODULES for t in module.MODEL_TYPES]
    assert len(types) == len(set(types)) == len(hf.FAMILIES)             # no model type in two families
    for name in hf.FAMILY_MODULES:
        module = importlib.import_module(f"tformer.interop.{name}")
        missing = [p for p in hf.PROTOCOL if not hasattr(module, p)]
        assert not missing, f"interop/{name}.py lacks {missing}"


def test_hf_py_names_no_family_outside_the_registry():
    """No family module is imported or named in hf.py's code and no model type is spelled there,
    so adding a family never means editing load_hf, save_hf or infer_model_type."""
    tree = ast.parse((INTEROP / "hf.py").read_text(encoding="utf-8"))
    registry = next(n for n in tree.body if isinstance(n, ast.Assign)
                    and any(getattr(t, "id", None) == "FAMILY_MODULES" for t in n.targets))
    in_registry = {id(n) for n in ast.walk(registry)}
    families = set(hf.FAMILY_MODULES) | set(hf.FAMILIES)
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.FunctionDef)) and n.body and isinstance(n.body[0], ast.Expr)}
    named = []
    for node in ast.walk(tree):
        if id(node) in in_registry or id(node) in docstrings:
            continue
        if isinstance(node, ast.Name) and node.id in families:
            named.append(node.id)
        elif isinstance(node, ast.Attribute) and node.attr in families:
            named.append(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in families:
            named.append(node.value)
        elif isinstance(node, ast.ImportFrom) and node.module == "tformer.interop":
            named.extend(a.name for a in node.names)
    assert not named, f"hf.py names families outside FAMILY_MODULES: {named}"


def _cfg(**kw):
    base = dict(vocab_size=40, context_length=32, n_layers=2, d_model=32, n_heads=4)
    return TransformerConfig(**{**base, **kw})


GEMMA = dict(positions="rope", norm="rmsnorm", ffn="geglu", activation="gelu_tanh", post_norms=True, norm_unit_offset=True)
CLAIMS = [
    (dict(positions="learned"), "gpt2"),
    (dict(positions="rope"), "gpt_neox"),                              # LayerNorm and a plain MLP
    (dict(positions="rope", norm="rmsnorm", ffn="swiglu"), "llama"),
    (dict(positions="rope", norm="rmsnorm"), "llama"),                  # Llama's export then names ffn
    (dict(positions="rope", norm="rmsnorm", ffn="swiglu", bias=False, qkv_bias=True), "qwen2"),
    (dict(positions="rope", norm="rmsnorm", ffn="swiglu", bias=False, sliding_window=8), "mistral"),
    (dict(positions="alibi"), "bloom"),
    (dict(causal=False), "bert"),
    (dict(mixer="mamba", positions="none", ffn="none"), "mamba"),
    (dict(causal=False, mixer="longformer", mixer_options={"longformer": {"window": 4}}), "longformer"),
    (dict(causal=False, mixer="bigbird", mixer_options={"bigbird": {"block_size": 4}}), "big_bird"),
    (dict(model="encoder-decoder", positions="learned"), "bart"),
    (dict(model="encoder-decoder", positions="sinusoidal"), "marian"),
    (GEMMA, "gemma2"),
    ({**GEMMA, "qk_norm": True, "qk_norm_gain": True}, "gemma3_text"),
    (dict(positions="rope", norm="rmsnorm", ffn="geglu"), None),      # a GELU gate without Gemma's norms
    (dict(mixer="performer"), None),
    (dict(mixer=["mamba", "attention"], positions="none"), None),
    (dict(model="encoder-decoder", positions="none"), None),
]


@pytest.mark.parametrize("kw, expected", CLAIMS)
def test_each_config_is_claimed_by_at_most_one_family(kw, expected):
    c = _cfg(**kw)
    claims = [t for t in (m.model_type_for(c) for m in hf.MODULES) if t is not None]
    assert claims == ([expected] if expected else [])
    if expected:
        assert hf.infer_model_type(c) == expected
    else:
        with pytest.raises(ConfigError, match="no HuggingFace family matches"):
            hf.infer_model_type(c)


@pytest.mark.parametrize("kw, model_type", [
    (dict(mixer="performer", positions="learned"), "gpt2"),
    (dict(causal=False, mixer="longformer", mixer_options={"longformer": {"window": 4}},
          norm_placement="post", embedding_norm=True, type_vocab_size=2), "bert"),
])
def test_export_refuses_a_mixer_the_family_does_not_have(kw, model_type):
    """GPT-2 and BERT hold softmax attention only: exporting another mixer under their name would
    write a checkpoint that computes something else."""
    with tempfile.TemporaryDirectory() as folder, pytest.raises(ConfigError, match="mixer='attention'"):
        hf.save_hf(build_model(_cfg(**kw)), folder, model_type=model_type)
