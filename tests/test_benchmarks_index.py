"""benchmarks/README.md indexes every benchmark script and every result file, truthfully.

Read as text only: no benchmark script is imported (they pull in peers, plots and minutes of work).
Checked: every ``.py`` under benchmarks/ is named in the index; every file under benchmarks/results/
has a row of the result table; a row's file exists unless the row says it is not yet written; a
markdown result without the record header (``common/record.py``'s mark) is marked as recorded before
the header existed; every script that writes a result goes through the record helper, which alone joins a
run's ``--tag`` to the file name; and no test
imports a benchmark script.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
INDEX = (BENCH / "README.md").read_text(encoding="utf-8")
MARK = "<!-- recorded by benchmarks/common/record.py -->"       # common/record.py's RECORD_MARK
BEFORE = "recorded before the header existed"
NOT_YET = "not yet written"


def rows() -> dict[str, str]:
    """result path (relative to benchmarks/) -> its row of the index's result table."""
    out = {}
    for line in INDEX.splitlines():
        m = re.match(r"\| \[(results/[^\]]+)\]\((results/[^)]+)\) \|", line)
        if m:
            assert m[1] == m[2], f"the row's label and link differ: {line}"
            assert m[1] not in out, f"{m[1]} has two rows in benchmarks/README.md"
            out[m[1]] = line
    return out


def scripts() -> list[Path]:
    return sorted(p for p in BENCH.rglob("*.py") if "__pycache__" not in p.parts and p.name != "__init__.py")


def test_every_script_is_listed():
    missing = [str(p.relative_to(BENCH)) for p in scripts() if f"`{p.relative_to(BENCH).as_posix()}" not in INDEX]
    assert not missing, f"benchmarks/README.md does not list {missing}; add a row to its Scripts table"


def test_every_result_file_has_a_row():
    listed = rows()
    files = sorted(p.relative_to(BENCH).as_posix() for p in (BENCH / "results").rglob("*") if p.is_file())
    assert files, "no result files found: is benchmarks/results/ where the index says?"
    missing = [f for f in files if f not in listed]
    assert not missing, f"benchmarks/README.md has no row for {missing}"


def test_a_listed_file_exists_unless_marked_not_yet_written():
    for path, line in rows().items():
        assert (BENCH / path).is_file() or NOT_YET in line, f"{path} is listed but missing (and not marked '{NOT_YET}')"
        if NOT_YET in line:
            assert not (BENCH / path).exists(), f"{path} exists now: replace '{NOT_YET}' in its row with its record"


def test_a_result_without_the_header_is_marked_as_such():
    for path, line in rows().items():
        file = BENCH / path
        if file.suffix == ".md" and file.is_file():
            has_header = MARK in file.read_text(encoding="utf-8")
            assert has_header or BEFORE in line, f"{path} has no record header, so its row must say '{BEFORE}'"
            assert not (has_header and BEFORE in line), f"{path} has its record header now: update its row"


def test_scripts_write_results_through_the_record_helper():
    """A script that writes a result file uses common/record.py (``Run(...).write`` / ``write_json``),
    so the file records commit, CPU, load and command; none writes results with a bare write_text."""
    for p in scripts():
        if p.parent.name == "common":
            continue
        text = p.read_text(encoding="utf-8")
        assert "from common.record import" in text, f"{p.relative_to(ROOT)} does not use benchmarks/common/record.py"
        assert not re.search(r"RESULTS[^\n]*write_text|\.md\"\)\.write_text", text), \
            f"{p.relative_to(ROOT)} writes a result without the record header"
    assert "from tformer.machine import busy_cores, cpu_info" in (BENCH / "common" / "record.py").read_text()


def test_result_names_take_their_tag_in_one_place():
    """A script names its result ``<name>[-<tag>]`` through common/record.py (``Run.write_result`` or
    ``result_name``), never by joining the tag itself."""
    joined = re.compile(r"""['"]-['"] \+ \w+\.tag|f['"]-\{\w+\.tag\}['"] if \w+\.tag""")
    offenders = [str(p.relative_to(ROOT)) for p in scripts()
                 if p.name != "record.py" and joined.search(p.read_text(encoding="utf-8"))]
    assert not offenders, f"{offenders} join --tag to a result name; call run.write_result(topic, name, tag, ...)"


def test_no_test_imports_a_benchmark_script():
    offenders = []
    for p in (ROOT / "tests").rglob("*.py"):
        text = p.read_text(encoding="utf-8")
        if re.search(r"sys\.path\.\w+\([^)]*benchmarks", text) or re.search(r"^\s*(from|import) benchmarks\b", text, re.M):
            offenders.append(str(p.relative_to(ROOT)))
    assert not offenders, f"these tests import benchmark scripts: {offenders}; move what they need into the library"
