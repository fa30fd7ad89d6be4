"""No tracked text file holds a merge's conflict markers (one sat in docs/architecture.md for a session
unnoticed: a table row doubled and the markers rendered as text)."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(rb"^(<<<<<<<|>>>>>>>) ", re.M)


def test_no_tracked_file_holds_conflict_markers():
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    marked = [n.decode() for n in names if n and (ROOT / n.decode()).is_file()
              and MARKER.search((ROOT / n.decode()).read_bytes())]
    assert not marked, f"conflict markers in {marked}"
