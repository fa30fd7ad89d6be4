"""Static against eager decoding is a choice of state class, not a branch in every mixer: no
mixer module's ``forward`` (or anything else on an ``nn.Module`` mixer) reads ``step.write_index``;
only state classes and the model's step builder do."""

from __future__ import annotations

import ast
from pathlib import Path

MIXERS = Path(__file__).resolve().parents[2] / "src" / "tformer" / "mixers"


def module_classes_reading(source: str, attr: str) -> list[str]:
    """Classes deriving from something named ``*Attention``/``Module``/``Mixer`` that mention ``attr``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            bases = [b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "") for b in node.bases]
            is_module = any(b == "Module" or b.endswith("Attention") or b.endswith("Mixer") for b in bases)
            reads = any(isinstance(n, ast.Attribute) and n.attr == attr for n in ast.walk(node))
            if is_module and reads:
                found.append(node.name)
    return found


def test_the_checker_sees_a_mixer_that_branches_on_the_step():
    src = ("class Bad(ProjectedAttention):\n    def forward(self, x, step, state):\n"
           "        return 1 if step.write_index is None else 2\n"
           "class State:\n    def store(self, k, v, step):\n        return step.write_index\n")
    assert module_classes_reading(src, "write_index") == ["Bad"]


def test_no_mixer_reads_the_static_write_index():
    files = sorted(MIXERS.glob("*.py"))
    assert len(files) >= 9
    found = {p.name: module_classes_reading(p.read_text(encoding="utf-8"), "write_index") for p in files}
    assert {k: v for k, v in found.items() if v} == {}
