"""The serving examples in docs/serving.md and the README run as written.

The code blocks are read from the documents themselves (docs/serving.md's "Examples" section, the
README's serving paragraph), not copied here, so a change to the docs that breaks them fails this
test. A server is started on a free loopback port and named like a `make train` run; the examples
find it through ``TFORMER_URL`` (their default is the real server's http://127.0.0.1:8000) and
read the model id from ``/v1/models``: nothing in a block is substituted.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from serve_util import Running, tiny_checkpoint
from tformer.serve.build import build_server
from tformer.serve.app import build_app

ROOT = Path(__file__).resolve().parents[2]


def blocks(text: str, start: str, end: str) -> list[tuple[str, str]]:
    """``(language, code)`` of the fenced blocks between the first ``start`` and the next ``end``."""
    i = text.index(start)
    j = text.index(end, i + len(start))
    return re.findall(r"```(\w+)\n(.*?)```", text[i:j], flags=re.S)


DOCS = blocks((ROOT / "docs/serving.md").read_text(), "### Examples", "\n### ")
README = blocks((ROOT / "README.md").read_text(), "**Serving.**", "\n## ")


@pytest.fixture(scope="module")
def url(tmp_path_factory, one_thread):
    folder = tmp_path_factory.mktemp("runs") / "tiny-20261129-180102"
    folder.mkdir()
    tiny_checkpoint(folder)
    server = build_server(str(folder), slots=4)
    running = Running(build_app(server))
    yield running.url
    running.stop()


def run_bash(code: str, url: str) -> str:
    env = {**os.environ, "TFORMER_URL": url,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}   # python3 = this venv's
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"the block failed:\n{code}\nstderr: {done.stderr}\nstdout: {done.stdout}"
    return done.stdout


def test_the_documents_hold_the_examples():
    assert [lang for lang, _ in DOCS] == ["bash", "python"]
    assert [lang for lang, _ in README] == ["bash"]


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_examples_run_as_written(url):
    out = run_bash(DOCS[0][1], url)
    assert '"object":"text_completion"' in out.replace(" ", "") and '"error"' not in out
    events = [line for line in out.splitlines() if line.startswith("data: ")]
    assert "chat.completion.chunk" in events[0] and events[-1] == "data: [DONE]"
    assert re.search(r"^tformer_pool_slots_in_use 0$", out, flags=re.M)          # `grep pool`: none held after
    out = run_bash(README[0][1], url)
    assert '"object":"text_completion"' in out.replace(" ", "") and '"error"' not in out


def test_openai_client_example_runs_as_written(url, monkeypatch):
    monkeypatch.setenv("TFORMER_URL", url)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(DOCS[1][1], "docs/serving.md", "exec"), {})                     # noqa: S102 (our own docs)
    lines = printed.getvalue().splitlines()
    assert lines[-1] == "384" and len(printed.getvalue()) > 10                      # text came back, then MiniLM's width
