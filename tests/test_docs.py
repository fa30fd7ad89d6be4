"""The docs name only what exists, and every module has its line in docs/architecture.md.

Read as text only (nothing is imported). What is checked:

- **Texts**: the documents in ``DOCUMENTS`` (``docs/*.md``) whole, and in ``src/tformer/`` every
  docstring and comment (Python docstrings and ``#`` comments, C++ ``//`` and ``/* */`` comments).
- **Module names**: ``tformer.a.b`` must be a module or package under ``src/tformer/``; a name left
  over after the longest such prefix (``tformer.models.MODELS``) must be defined at the top level of
  that module (a def, class, assignment or import; a module with a lazy ``__getattr__`` lists its
  lazy names in a literal dict or its ``__all__``).
- **File paths**: a path-like word (``segment/segment...``, ending in a file name with an extension
  or in ``/``) whose first segment is a top-level entry of one of the roots below must exist under
  one of them: the repository, ``src/``, ``src/tformer/``, ``benchmarks/``, and the text's own
  folder. So ``src/...``, ``tests/...``, ``benchmarks/...``, ``docs/...``, ``ops/sdpa.py`` (from
  ``src/tformer``) and ``results/...`` (from ``benchmarks``) are all checked; a word whose first
  segment is none of those (``runs/shakespeare/``, ``~/.cache/...``) is taken as an example, not a
  claim. Placeholders are skipped (a path running into ``<``, ``{``, ``*``, ``…``). A path followed
  by ``#anchor`` that names a markdown file must find that heading in it.
- **Markdown links** in the documents: a relative link's target must exist; an anchor
  (``file.md#heading`` or ``#heading``) must be a heading of the target (GitHub's slugs) or an
  explicit ``<a id=...>``. External links (``scheme:``) are not followed.
- **No timings in code**: a docstring or comment under ``src/tformer/`` carries no measured time or
  rate (``0.42 ms``, ``80 tok/s``, ``1 GB/s``, ``0.4 s per run``): those go stale with the machine,
  so they live in ``docs/`` or ``benchmarks/results/``, and the code keeps the rule, the reason and a
  pointer there.
- **Architecture rows**: every source file under ``src/tformer/`` (``.py``, ``.cpp``, ``.h``) is
  matched by a path in the first cell of a row of docs/architecture.md's module tables (a path, a
  glob, or a folder ending in ``/``), and every such path matches at least one file.

``test_the_checker_reports_planted_stale_names`` keeps the checker honest: a temporary document with
one stale name of each kind must be reported, and its good twin must not.
"""

from __future__ import annotations

import ast
import fnmatch
import io
import re
import tokenize
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "tformer"
DOCS = ROOT / "docs"
ARCHITECTURE = DOCS / "architecture.md"

# The documents checked whole.
DOCUMENTS = sorted(DOCS.glob("*.md")) + [ROOT / "README.md"]

# Stale names in files that other work is rewriting now, as (file, name): reported there, not fixed
# here. Each entry must still be found: delete it when its file is fixed or gone.
PENDING: set[tuple[str, str]] = set()

# Timings still in files other work is rewriting now, as (file, figure); the same rule as PENDING.
PENDING_FIGURES: set[tuple[str, str]] = set()

SOURCE_SUFFIXES = {".py", ".cpp", ".h"}
# A path-like word is a file claim only if its last segment ends in one of these (``nn/feed_forward.gelu``
# names a function, not a file).
FILE_SUFFIXES = {".py", ".cpp", ".h", ".md", ".html", ".js", ".css", ".json", ".jsonl", ".csv", ".tsv", ".txt",
                 ".toml", ".png", ".svg", ".sh", ".yml", ".yaml", ".cfg"}
ROOTS = [ROOT, ROOT / "src", SRC, ROOT / "benchmarks"]


@dataclass(frozen=True)
class Finding:
    where: str          # file:line
    what: str           # the name as written
    why: str

    def __str__(self) -> str:
        return f"{self.where}: {self.what} ({self.why})"


# --- the texts ---------------------------------------------------------------------------------


def python_texts(path: Path) -> list[tuple[int, str]]:
    """(first line, text) for every docstring and comment of a Python file."""
    source = path.read_text(encoding="utf-8")
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                out.append((first.lineno, first.value.value))
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
    return out


def cpp_texts(path: Path) -> list[tuple[int, str]]:
    source = path.read_text(encoding="utf-8")
    return [(source.count("\n", 0, m.start()) + 1, m.group()) for m in re.finditer(r"//[^\n]*|/\*.*?\*/", source, re.S)]


def texts() -> list[tuple[Path, int, str]]:
    """(file, first line, text) for every text the checker reads."""
    out = [(doc, 1, doc.read_text(encoding="utf-8")) for doc in DOCUMENTS]
    for path in sorted(SRC.rglob("*")):
        if path.suffix == ".py":
            out += [(path, line, text) for line, text in python_texts(path)]
        elif path.suffix in {".cpp", ".h"}:
            out += [(path, line, text) for line, text in cpp_texts(path)]
    return out


def where(path: Path, first_line: int, text: str, offset: int) -> str:
    try:
        name = path.relative_to(ROOT).as_posix()
    except ValueError:
        name = str(path)
    return f"{name}:{first_line + text.count(chr(10), 0, offset)}"


# --- module names ------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def top_level_names(path: Path) -> frozenset[str]:
    """Names a module defines at its top level (lazy ``__getattr__`` names from a literal dict or ``__all__``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
            value = node.value
            if isinstance(value, ast.Dict) and "__getattr__" in {getattr(n, "name", None) for n in tree.body}:
                names.update(k.value for k in value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str))
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and isinstance(value, (ast.List, ast.Tuple)):
                names.update(e.value for e in value.elts if isinstance(e, ast.Constant))
    return frozenset(names)


def module_file(parts: list[str]) -> Path | None:
    """The file of module ``tformer.<parts>`` (its ``__init__.py`` for a package), or None."""
    base = SRC.joinpath(*parts)
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    return None


MODULE_NAME = re.compile(r"(?<![\w./-])tformer(?:\.[A-Za-z_]\w*)+")


def check_module_name(name: str) -> str | None:
    """None if ``name`` exists, else why not."""
    parts = name.split(".")[1:]
    for i in range(len(parts), -1, -1):
        file = module_file(parts[:i])
        if file is None:
            continue
        if i == len(parts):
            return None
        if parts[i] in top_level_names(file):
            return None
        what = "tformer." + ".".join(parts[:i]) if i else "tformer"
        return f"{what} has no module or top-level name {parts[i]!r}"
    return "no such module"


# --- file paths --------------------------------------------------------------------------------

PATH = re.compile(r"(?<![\w./~-])(?:[\w.-]+/)+[\w.-]*")
PLACEHOLDER = set("<{*…[$")


def entries(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir() if not p.name.startswith(".")} if folder.is_dir() else set()


@lru_cache(maxsize=None)
def known_firsts(own: Path) -> frozenset[str]:
    out: set[str] = {"tformer"}
    for root in [*ROOTS, own]:
        out |= entries(root)
    return frozenset(out)


def check_path(word: str, own: Path) -> str | None:
    """None if ``word`` is not a path claim or names something that exists; else why not."""
    first = word.split("/")[0]
    if first in {".", ".."} or first not in known_firsts(own):
        return None
    last = word.rstrip("/").rsplit("/", 1)[-1]
    if not word.endswith("/") and Path(last).suffix not in FILE_SUFFIXES:
        return None
    for root in [*ROOTS, own]:
        if (root / word).exists():
            return None
    return "no such file or folder"


# --- anchors -----------------------------------------------------------------------------------


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup and punctuation dropped, lower case, spaces to hyphens."""
    text = re.sub(r"`|\*\*|__|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip())
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


@lru_cache(maxsize=None)
def anchors(doc: Path) -> frozenset[str]:
    text = doc.read_text(encoding="utf-8")
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.M):
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    out.update(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", text))
    return frozenset(out)


def check_anchor(target: Path, anchor: str) -> str | None:
    if target.suffix != ".md" or not target.is_file() or not anchor:
        return None
    return None if anchor in anchors(target) else f"{target.name} has no heading #{anchor}"


# --- the checks over one text ------------------------------------------------------------------

LINK = re.compile(r"\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def check_text(path: Path, first_line: int, text: str, markdown: bool, own: Path | None = None) -> list[Finding]:
    """Every stale name in ``text`` (from ``path``, starting at ``first_line``); relative names and links
    resolve from ``own`` (default: the file's folder)."""
    own = own or path.parent
    found = []
    for m in MODULE_NAME.finditer(text):
        why = check_module_name(m.group())
        if why:
            found.append(Finding(where(path, first_line, text, m.start()), m.group(), why))
    for m in PATH.finditer(text):
        word = m.group().rstrip(".-")
        after = text[m.start() + len(word): m.start() + len(word) + 1]
        if after in PLACEHOLDER:
            continue
        why = check_path(word, own)
        if why is None and after == "#":
            anchor = re.match(r"#([\w-]+)", text[m.start() + len(word):])
            target = next((r / word for r in [*ROOTS, own] if (r / word).is_file()), None)
            if anchor and target is not None:
                why = check_anchor(target, anchor.group(1))
        if why:
            found.append(Finding(where(path, first_line, text, m.start()), word, why))
    if markdown:
        for m in LINK.finditer(text):
            link = m.group(1)
            if re.match(r"[a-zA-Z][\w+.-]*:", link):
                continue
            file, _, anchor = link.partition("#")
            target = (own / file).resolve() if file else path
            if not target.exists():
                why = "link target does not exist"
            else:
                why = check_anchor(target, anchor)
            if why:
                found.append(Finding(where(path, first_line, text, m.start()), link, why))
    return found


FIGURE = re.compile(r"\d(?:[\d,.]*\d)?\s?(?:ms|µs|us|ns|tok/s|GB/s|MB/s|GFLOP/s)(?![\w/])"
                    r"|\d(?:\.\d+)?\s?s (?:a|per) (?:step|token|run|call)\b")


def check_figures(path: Path, first_line: int, text: str) -> list[Finding]:
    """Every measured time or rate in a docstring or comment."""
    return [Finding(where(path, first_line, text, m.start()), m.group(), "a measured figure belongs in docs/")
            for m in FIGURE.finditer(text)]


def figures_in_code() -> list[Finding]:
    return [f for path, line, text in texts() if path.is_relative_to(SRC) for f in check_figures(path, line, text)]


def split_pending(found: list[Finding], pending: set[tuple[str, str]]) -> tuple[list[Finding], set[tuple[str, str]]]:
    """(findings not pending, pending entries no longer found)."""
    key = lambda f: (f.where.rsplit(":", 1)[0], f.what)  # noqa: E731
    return [f for f in found if key(f) not in pending], pending - {key(f) for f in found}


def stale_names() -> list[Finding]:
    out = []
    for path, line, text in texts():
        out += check_text(path, line, text, markdown=path.suffix == ".md")
    return out


# --- architecture.md's module tables -----------------------------------------------------------


def architecture_patterns(text: str) -> list[tuple[int, str]]:
    """(line, pattern) for each backticked path in the first cell of a row of the module tables."""
    out = []
    section = text.split("## Every module, in one line", 1)[1].split("\n## ", 1)[0]
    offset = text.count("\n", 0, text.index("## Every module, in one line")) + 1
    for i, line in enumerate(section.splitlines()):
        if not line.startswith("| ") or line.startswith("| module") or line.startswith("|---"):
            continue
        first_cell = line.split("|")[1]
        out += [(offset + i, p) for p in re.findall(r"`([^`]+)`", first_cell)]
    return out


def source_files() -> list[str]:
    return sorted(p.relative_to(SRC).as_posix() for p in SRC.rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts)


def matches(pattern: str, file: str) -> bool:
    if pattern.endswith("/"):
        return file.startswith(pattern)
    return fnmatch.fnmatchcase(file, pattern)


def architecture_gaps(text: str) -> tuple[list[str], list[str]]:
    """(source files with no row, row paths that match no file)."""
    patterns = architecture_patterns(text)
    files = source_files()
    missing = [f for f in files if Path(f).suffix in SOURCE_SUFFIXES
               and not any(matches(p, f) for _, p in patterns)]
    empty = [f"docs/architecture.md:{line}: {p}" for line, p in patterns if not any(matches(p, f) for f in files)]
    return missing, empty


# --- the tests ---------------------------------------------------------------------------------


def test_docs_name_only_what_exists():
    stale, fixed = split_pending(stale_names(), PENDING)
    assert not stale, "stale names in docs and docstrings:\n" + "\n".join(map(str, stale))
    assert not fixed, f"PENDING entries no longer found (fixed or moved): delete {sorted(fixed)} from tests/test_docs.py"


def test_no_measured_figures_in_code():
    found, fixed = split_pending(figures_in_code(), PENDING_FIGURES)
    assert not found, ("timings in docstrings and comments (move each to docs/ or benchmarks/results/ and leave "
                       "the rule, the reason and a pointer):\n" + "\n".join(map(str, found)))
    assert not fixed, f"PENDING_FIGURES entries no longer found: delete {sorted(fixed)} from tests/test_docs.py"


def test_every_module_has_a_row_in_architecture():
    missing, empty = architecture_gaps(ARCHITECTURE.read_text(encoding="utf-8"))
    assert not missing, f"docs/architecture.md has no row for {missing}: add one to its module tables"
    assert not empty, "rows of docs/architecture.md that match no file:\n" + "\n".join(empty)


def test_the_checker_reports_planted_stale_names(tmp_path):
    """A document with one stale name of each kind is reported name by name; its good twin is clean.
    Both are written to a temporary folder and read as if they sat in docs/."""
    stale = tmp_path / "stale.md"
    stale.write_text(
        "# Stale\n\n"
        "The kernel lives in `tformer.attention.flash` and `tformer.ops.sdpa.no_such_function`;\n"
        "see src/tformer/attention/flash.py, ``ops/flash_v2.py``, tests/ops/test_gone.py and\n"
        "docs/inference.md#no-such-heading, or [the guide](../docs/gone.md) and [here](#nowhere).\n",
        encoding="utf-8")
    found = {f.what: f for f in check_text(stale, 1, stale.read_text(encoding="utf-8"), markdown=True, own=DOCS)}
    assert set(found) == {
        "tformer.attention.flash", "tformer.ops.sdpa.no_such_function", "src/tformer/attention/flash.py",
        "ops/flash_v2.py", "tests/ops/test_gone.py", "docs/inference.md", "../docs/gone.md", "#nowhere",
    }, found
    assert found["ops/flash_v2.py"].where.endswith("stale.md:4")

    good = tmp_path / "good.md"
    good.write_text(
        "# Good\n\n"
        "The kernel lives in `tformer.ops.flash` and `tformer.ops.sdpa.scaled_dot_product_attention`;\n"
        "see src/tformer/ops/flash.py, ``ops/flash.py``, tests/test_docs.py, runs/shakespeare/ and\n"
        "docs/architecture.md#every-module-in-one-line, or [the guide](../docs/inference.md) and [here](#good).\n"
        "Placeholders: `mixers/<name>.py`, `claims/catalog/c*.py`; [a site](https://example.com/x.md).\n",
        encoding="utf-8")
    assert check_text(good, 1, good.read_text(encoding="utf-8"), markdown=True, own=DOCS) == []

    module = tmp_path / "module.py"
    module.write_text('"""Moved to ``tformer.attention``."""\n\nX = 1  # see attention/flash.py\n'
                      'def f():\n    """Read src/tformer/ops/flash.py."""\n    return "tformer.gone"\n',
                      encoding="utf-8")
    found = [f for line, text in python_texts(module) for f in check_text(module, line, text, markdown=False, own=SRC / "ops")]
    assert [(f.what, f.where.rsplit(":", 1)[1]) for f in found] == [("tformer.attention", "1"), ("attention/flash.py", "3")], found

    figures = [f.what for line, text in python_texts(module) for f in check_figures(module, line, text)]
    assert figures == []
    timed = tmp_path / "timed.py"
    timed.write_text('"""One pass: 0.42 against 1.61 ms, 80-81 tok/s, 1 GB/s; 0.4 s per run."""\n'
                     '# a millisecond, 4 heads, 12 µs\n', encoding="utf-8")
    figures = [f.what for line, text in python_texts(timed) for f in check_figures(timed, line, text)]
    assert figures == ["1.61 ms", "81 tok/s", "1 GB/s", "0.4 s per run", "12 µs"], figures

    missing, empty = architecture_gaps(
        "## Every module, in one line\n\n| module | purpose |\n|---|---|\n| `ops/*.py`, `gone.py` | x |\n")
    assert "nn/norms.py" in missing and "ops/sdpa.py" not in missing
    assert empty == ["docs/architecture.md:5: gone.py"]


if __name__ == "__main__":
    for finding in stale_names() + figures_in_code():
        print(finding)
    missing, empty = architecture_gaps(ARCHITECTURE.read_text(encoding="utf-8"))
    print("no row:", *missing, sep="\n  ")
    print("matching nothing:", *empty, sep="\n  ")
