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
            page.goto(running.url + "/")
            page.wait_for_function("document.getElementById('model').textContent === %r" % server.name)
            page.fill("#prompt", "def add(a, b):")
            page.fill("#max_tokens", "12")
            page.fill("#temperature", "0")
            page.click("#generate")
            page.wait_for_function("document.querySelectorAll('#tokens .tok').length === 12", timeout=20000)
            page.wait_for_selector("#generate:not([disabled])")
            page.locator("#tokens .tok").nth(5).click()
            page.wait_for_selector("#explain:not([hidden])")
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
            page.goto(running.url + "/")
            page.wait_for_function("document.getElementById('model').textContent === 'smollm2'")
            page.fill("#prompt", "The capital of France is")
            page.fill("#max_tokens", "4")
            page.fill("#temperature", "0")
            page.click("#generate")
            page.wait_for_function("document.querySelectorAll('#tokens .tok').length === 4", timeout=60000)
            page.wait_for_selector("#generate:not([disabled])")
            page.locator("#tokens .tok").nth(1).click()
            page.wait_for_selector("#explain:not([hidden])", timeout=60000)
            context = len(server.tokenizer.encode("The capital of France is")) + 1
            cells = page.locator("#attribution tr.attribution-row td.cell")
            assert cells.count() == context
            c = server.model.config
            assert page.locator("#attention tr.head-row").count() == c.n_layers * c.n_heads
            browser.close()
    finally:
        running.stop()
        server.close()
