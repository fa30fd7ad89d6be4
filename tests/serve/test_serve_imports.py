"""The server uses the library through its public names only: no module under ``src/tformer/serve``
imports a private (``_name``) function, class or module from another tformer package, or reaches
one as an attribute of an imported module (``generate._stepper``). What the server needs from
generation is the public pair ``tformer.generation.step.prefill`` / ``decode_step``."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "tformer"


def private_uses(source: str, package: str) -> list[str]:
    """``module.name`` for every private name ``source`` (a module of ``tformer.<package>``) takes
    from another tformer package."""
    def foreign(module: str) -> bool:
        parts = module.split(".")
        return parts[0] == "tformer" and len(parts) > 1 and parts[1] != package

    def private(name: str) -> bool:
        return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))

    found, modules = [], {}                                   # local name -> the tformer module it is
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level and foreign(node.module):
            if any(private(p) for p in node.module.split(".")):
                found.append(node.module)
            for alias in node.names:
                if private(alias.name):
                    found.append(f"{node.module}.{alias.name}")
                else:
                    modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if foreign(alias.name):
                    if any(private(p) for p in alias.name.split(".")):
                        found.append(alias.name)
                    modules[alias.asname or alias.name.split(".")[0]] = alias.asname and alias.name or "tformer"
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and private(node.attr) and isinstance(node.value, ast.Name)
                and node.value.id in modules):
            found.append(f"{modules[node.value.id]}.{node.attr}")
    return found


def test_the_checker_sees_each_kind_of_private_use():
    src = ("from tformer.generation.text import _TextTracker, TextTracker\n"
           "from tformer.models import state\n"
           "import tformer.generation._hidden\n"
           "from tformer.serve.pool import _mine\n"           # the server's own private names are its business
           "x = state._assemble\n")
    assert private_uses(src, "serve") == ["tformer.generation.text._TextTracker", "tformer.generation._hidden",
                                          "tformer.models.state._assemble"]


def test_no_serve_module_imports_a_private_name_from_another_package():
    files = sorted((SRC / "serve").rglob("*.py"))
    assert len(files) >= 8
    found = {str(p.relative_to(SRC)): private_uses(p.read_text(encoding="utf-8"), "serve") for p in files}
    assert {k: v for k, v in found.items() if v} == {}
