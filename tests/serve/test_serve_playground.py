"""The playground in a real browser: Debian's headless Chromium driven by Playwright (never its own
browser download). Type a prompt, wait for streamed tokens, click one, check the heatmap has one row
per layer and head, the attribution one cell per context token, the logit lens one row per layer
(+1), and that clicking a head ablates it (the prediction is recomputed without it); the screenshot goes to
$TFORMER_SCREENSHOT when set (the README's picture is made this way)."""

from __future__ import annotations

import os
import shutil

import pytest

from serve_util import Running, tiny_checkpoint
from tformer.serve.build import build_server
from tformer.serve.app import build_app

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run"]

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="needs Debian's chromium (.ci/run installs it)")


def explain_a_token(page, url: str, name: str, prompt: str, max_tokens: int, pick: int, timeout: float) -> None:
    """In the playground at ``url``: generate ``max_tokens`` greedy tokens after ``prompt`` and click token
    ``pick``, waiting for its explanation to show."""
    page.goto(url + "/")
    page.wait_for_function("document.getElementById('model').textContent === %r" % name)
    page.fill("#prompt", prompt)
    page.fill("#max_tokens", str(max_tokens))
    page.fill("#temperature", "0")
    page.click("#generate")
    page.wait_for_function(f"document.querySelectorAll('#tokens .tok').length === {max_tokens}", timeout=timeout)
    page.wait_for_selector("#generate:not([disabled])")
    page.locator("#tokens .tok").nth(pick).click()
    page.wait_for_selector("#explain:not([hidden])", timeout=timeout)


def test_playground_streams_and_explains_a_token(tmp_path, one_thread):
    sync_api = pytest.importorskip("playwright.sync_api")
    model, tok = tiny_checkpoint(tmp_path)
    server = build_server(str(tmp_path), slots=4)
    running = Running(build_app(server))
    c = model.config
    try:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            explain_a_token(page, running.url, server.name, "def add(a, b):", 12, pick=5, timeout=20000)
            rows = page.locator("#attention tr.head-row")
            assert rows.count() == c.n_layers * c.n_heads
            context = len(tok.encode("def add(a, b):")) + 5
            assert rows.nth(0).locator("td.cell").count() == context
            assert page.locator("#attribution tr.attribution-row td.cell").count() == context
            assert "finish_reason: length" in page.text_content("#status")
            # The logit lens: one row per block input and one after the last block.
            assert page.locator("#lens tr.lens-row").count() == c.n_layers + 1
            assert "click a head" in page.text_content("#ablation").lower()
            # Ablate head (1, 0): its row is marked and the prediction is computed again without it.
            rows.nth(c.n_heads).click()
            page.wait_for_function("document.getElementById('ablation').textContent.includes('L1 H0 ablated')")
            assert page.locator("#attention tr.ablated").count() == 1
            shot = os.environ.get("TFORMER_SCREENSHOT") or str(tmp_path / "playground.png")
            page.screenshot(path=shot, full_page=True)
            browser.close()
        assert os.path.getsize(shot) > 10_000
    finally:
        running.stop()


def test_the_playground_explains_a_token_on_the_default_server(one_thread):
    """The README's `tformer serve --model smollm2`: Q4_1 blocks, whose attribution needs the block layers'
    input gradient (issue 49 item 10: it was a 500)."""
    sync_api = pytest.importorskip("playwright.sync_api")
    from tformer.errors import CheckpointError
    from tformer.interop.builtin import builtin_path

    try:
        builtin_path("smollm2")
    except CheckpointError as e:
        pytest.skip(str(e))
    server = build_server("smollm2", slots=2)
    assert server.opened.dtype == "q4_1"
    running = Running(build_app(server))
    try:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            explain_a_token(page, running.url, "smollm2", "The capital of France is", 4, pick=1, timeout=60000)
            context = len(server.tokenizer.encode("The capital of France is")) + 1
            cells = page.locator("#attribution tr.attribution-row td.cell")
            assert cells.count() == context
            c = server.model.config
            assert page.locator("#attention tr.head-row").count() == c.n_layers * c.n_heads
            browser.close()
    finally:
        running.stop()
        server.close()
