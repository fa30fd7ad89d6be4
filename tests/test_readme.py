"""README.md is a front door: short, every link lands, every benchmark figure names its source.

Read as text only. Checked: the README has at most 150 lines; every relative link (and its
``#anchor``, against the target's headings) resolves; every guide under docs/ has a row in the README's
guide table; and in the benchmark table each cell that holds a number holds exactly one figure (in
bold) and exactly one link, to a file that exists under benchmarks/results/. The checkers are plain
functions, each also shown catching a planted fault in a text of the test's own.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES = 150
RESULTS = "benchmarks/results/"

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
# A number a reader would take for a figure: digits not glued to a word (SmolLM2-135M, fp32, Q4_1 and
# GPT-2 are names, not figures).
NUMBER = re.compile(r"(?<![\w\-./])[−-]?\d[\d,.]*")
BOLD = re.compile(r"\*\*[^*]+\*\*")


def prose(text: str) -> str:
    """``text`` without fenced code blocks and HTML comments (links there are not links)."""
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    return re.sub(r"^```.*?^```[ \t]*$", "", text, flags=re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor a markdown file's headings make (a repeated heading gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", prose(text), flags=re.M):
        base = slug(m[1])
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(text: str) -> list[str]:
    return [a or b for a, b in LINK.findall(prose(text))]


def broken_links(text: str, base: Path) -> list[str]:
    """The relative links of ``text`` (a file in folder ``base``) that do not resolve: no such file,
    or an ``#anchor`` that no heading of the target makes."""
    bad = []
    for target in links(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):             # http:, https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        file = (base / path).resolve() if path else None
        if file is not None and not file.exists():
            bad.append(target)
        elif anchor:
            heads = anchors(file.read_text(encoding="utf-8") if file else text)
            if (file is None or file.suffix == ".md") and anchor not in heads:
                bad.append(target)
    return bad


def table_after(text: str, heading: str) -> list[list[str]]:
    """The cells of each body row of the first table under ``heading`` (header and rule left out)."""
    section = text[text.index(heading):]
    rows = []
    for line in section.splitlines()[1:]:
        if line.startswith("#"):
            break
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif rows:
            break
    assert len(rows) >= 3, f"no table under {heading!r}"
    return rows[2:]


def unsourced_figures(rows: list[list[str]], root: Path) -> list[str]:
    """Cells that hold a number but not exactly one bold figure and one link to an existing result file."""
    bad = []
    for row in rows:
        for cell in row:
            plain = LINK.sub(lambda m: m[0][: m[0].index("](")], cell)       # numbers in a link's target do not count
            if not NUMBER.search(plain):
                continue
            targets = links(cell)
            if len(targets) != 1 or len(BOLD.findall(cell)) != 1:
                bad.append(f"{cell}  (wants one bold figure and one link, has {len(BOLD.findall(cell))} and {len(targets)})")
            elif not (targets[0].startswith(RESULTS) and (root / targets[0].partition("#")[0]).is_file()):
                bad.append(f"{cell}  (its link is not a file under {RESULTS})")
    return bad


def test_readme_is_short():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= MAX_LINES, f"README.md has {n} lines; the front door keeps to {MAX_LINES}: move detail into a guide"


def test_every_relative_link_resolves():
    bad = broken_links(README.read_text(encoding="utf-8"), ROOT)
    assert not bad, f"README.md links to what does not exist: {bad}"


def test_every_guide_has_a_row():
    rows = table_after(README.read_text(encoding="utf-8"), "## Guides")
    listed = {t for row in rows for t in links(row[0])}
    missing = [f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md")) if f"docs/{p.name}" not in listed]
    assert not missing, f"the README's guide table has no row for {missing}"


def test_every_benchmark_figure_links_its_result_file():
    rows = table_after(README.read_text(encoding="utf-8"), "## Benchmarks")
    assert len(rows) >= 5
    bad = unsourced_figures(rows, ROOT)
    assert not bad, "benchmark cells without their result file:\n" + "\n".join(bad)


def test_the_link_checker_catches_a_planted_bad_link(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "guide.md").write_text("# A guide\n\n## Speed, measured\n\ntext\n", encoding="utf-8")
    text = ("# Front\n\n## Usage\n\n[guide](docs/guide.md), [section](docs/guide.md#speed-measured), "
            "[here](#usage), [web](https://example.org/x)\n"
            "[gone](docs/missing.md) [wrong section](docs/guide.md#speed) [wrong here](#use)\n"
            "```\n[in code](docs/not-a-link.md)\n```\n")
    assert broken_links(text, tmp_path) == ["docs/missing.md", "docs/guide.md#speed", "#use"]


def test_the_figure_checker_catches_a_figure_without_its_file(tmp_path):
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "run.md").write_text("x", encoding="utf-8")
    text = ("## Benchmarks\n\n| what | CPU | result |\n|---|---|---|\n"
            "| decode SmolLM2-135M, fp32 | AVX-512 | [**1.5×** the peer](benchmarks/results/run.md) |\n"
            "| no link | Xeon | **2.0×** the peer |\n"
            "| missing file | Xeon | [**3.0×**](benchmarks/results/gone.md) |\n"
            "| two figures | Xeon | [**1.1×** and **1.2×**](benchmarks/results/run.md) |\n"
            "| not a result | Xeon | [**4.0×**](docs/guide.md) |\n"
            "| a number here: 4,096 tokens | Xeon | [**5.0×**](benchmarks/results/run.md) |\n")
    bad = unsourced_figures(table_after(text, "## Benchmarks"), tmp_path)
    assert [b.split("  (")[0] for b in bad] == [
        "**2.0×** the peer", "[**3.0×**](benchmarks/results/gone.md)",
        "[**1.1×** and **1.2×**](benchmarks/results/run.md)", "[**4.0×**](docs/guide.md)",
        "a number here: 4,096 tokens"]
