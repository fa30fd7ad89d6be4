"""The package's import graph: no circles (imports inside functions counted) and no package that
imports one above it. Run as a script to print the graph: ``python tests/test_layering.py``.

The layers, lowest first; a module may import only from its own layer or below. ``commands/``
imports its command's dependencies inside each ``run`` on purpose (a fast ``tformer --help``), and
those edges point downward as well, so no exception is needed.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "tformer"

LAYERS = [
    ["errors", "exits"],
    ["config", "io"],
    ["machine", "extensions", "ops"],
    ["nn"],
    ["mixers"],
    ["models", "accounting"],
    ["checkpoint", "quant"],
    ["fused"],
    ["generation"],
    ["template_worker", "tokenizers", "spm"],
    ["training", "interop", "interp", "inference"],
    ["serve", "scaling", "claims", "evaluation"],
    ["commands"],
    ["cli", "__main__"],
]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}


def modules() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the tformer modules it imports anywhere in its file (functions included)."""
    mods = modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            graph[name].update(t for t in targets if t in mods and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, on, stack, found, counter = {}, {}, set(), [], [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def top(module: str) -> str:
    """``tformer.mixers.attention`` -> ``mixers``; the package itself -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for a, targets in sorted(graph.items()):
        for b in sorted(targets):
            ta, tb = top(a), top(b)
            if ta == "" or ta == tb:            # the package's own __init__ gathers the public names
                continue
            if RANK[tb] > RANK[ta]:
                bad.append(f"{a} (layer {RANK[ta]}) imports {b} (layer {RANK[tb]})")
    return bad


def test_no_import_circles():
    assert cycles(import_graph()) == []


def test_every_module_is_in_a_layer():
    assert sorted({top(m) for m in modules()} - set(RANK) - {""}) == []


def test_no_package_imports_one_above_it():
    assert upward_imports(import_graph()) == []


if __name__ == "__main__":
    g = import_graph()
    print(f"{len(modules())} modules, {sum(map(len, g.values()))} import edges")
    print("circles:", cycles(g) or "none")
    print("upward imports:", upward_imports(g) or "none")
    edges = defaultdict(set)
    for a, bs in g.items():
        for b in bs:
            if top(a) != top(b) and top(a):
                edges[top(a)].add(top(b))
    for layer in LAYERS:
        for name in layer:
            print(f"  {RANK[name]:2d} {name:12s} -> {', '.join(sorted(edges[name], key=RANK.get)) or '-'}")
    sys.exit(1 if cycles(g) or upward_imports(g) else 0)
