"""The claims report in a real browser: Debian's headless Chromium, driven by Playwright (never its own
browser download). Every claim's section, figure and verdict must render; the screenshot is checked
structurally (size, not blank, the verdict colours present), not pixel by pixel."""

import os
import shutil
import tempfile

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run"]

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")


def test_report_renders_every_claim_in_chromium(claims_report):
    check_report_in_chromium(*claims_report)


def test_the_committed_full_report_renders_every_claim_in_chromium(tmp_path):
    """docs/claims-report.html, the full run's page as committed: one section per claim of the registry, in
    order, each with its verdict, and a decoded figure for every claim that was measured."""
    from pathlib import Path

    from tformer.claims import all_claims

    page = Path(__file__).resolve().parents[2] / "docs" / "claims-report.html"
    found, height, shot, requests = render_in_chromium(page, tmp_path / "screenshot.png")
    assert [f["name"] for f in found] == [c.name for c in all_claims()]
    for f in found:
        assert f["verdict"] in f["title"] and f["verdictColour"] not in ("rgba(0, 0, 0, 0)", "transparent")
        if f["verdict"] in ("reproduced", "partly", "not reproduced"):
            assert f["imgWidth"] > 300 and f["imgShown"] > 300 and f["rows"] > 1 and f["checks"] > 0, f
    assert all(u.startswith(("file:", "data:")) for u in requests), requests
    check_screenshot(shot, height)


def render_in_chromium(page_path, shot):
    """Open ``page_path`` in headless Chromium: (per-section facts, page height, screenshot path, requests)."""
    sync_api = pytest.importorskip("playwright.sync_api")
    with tempfile.TemporaryDirectory() as profile, sync_api.sync_playwright() as p:  # --user-data-dir=profile
        browser = p.chromium.launch_persistent_context(profile, executable_path=CHROMIUM, headless=True,
                                                       args=FLAGS, viewport={"width": 1200, "height": 900})
        try:
            page = browser.new_page()
            requests = []
            page.on("request", lambda r: requests.append(r.url))
            page.goto(page_path.resolve().as_uri())
            page.wait_for_load_state("load")
            found = page.evaluate("""() => [...document.querySelectorAll('section.claim')].map(s => ({
                name: s.dataset.claim,
                title: s.querySelector('h2').innerText,
                verdict: s.querySelector('.verdict').dataset.verdict,
                verdictColour: getComputedStyle(s.querySelector('.verdict')).backgroundColor,
                imgWidth: s.querySelector('img.plot') ? s.querySelector('img.plot').naturalWidth : 0,
                imgShown: s.querySelector('img.plot') ? s.querySelector('img.plot').getBoundingClientRect().width : 0,
                rows: s.querySelectorAll('table.rows tr').length,
                checks: s.querySelectorAll('ul.checks li').length,
            }))""")
            height = page.evaluate("document.documentElement.scrollHeight")
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    return found, height, shot, requests


def check_screenshot(shot, height):
    from matplotlib.image import imread

    image = imread(str(shot))                                           # (H, W, 4) floats in [0, 1]
    assert image.shape[1] == 1200 and abs(image.shape[0] - height) <= 2
    assert image[..., :3].std() > 0.05                                  # not a blank page


def check_report_in_chromium(out, results):
    found, height, shot, requests = render_in_chromium(out / "index.html", out / "screenshot.png")
    assert [f["name"] for f in found] == [c["name"] for c in results["claims"]]
    for f, c in zip(found, results["claims"]):
        assert f["verdict"] == c["verdict"] and c["verdict"] in f["title"]
        if c["verdict"] in ("unavailable", "not run"):                  # no figure: the reason is shown instead
            assert f["imgWidth"] == 0 and f["checks"] == 0
            continue
        assert f["imgWidth"] > 300 and f["imgShown"] > 300, f          # the PNG decoded and is on the page
        assert f["rows"] == len(c["rows"]) + 1 and f["checks"] == len(c["checks"])
        assert f["verdictColour"] not in ("rgba(0, 0, 0, 0)", "transparent")   # the inline CSS applied
    assert all(u.startswith(("file:", "data:")) for u in requests), requests     # nothing from the network
    check_screenshot(shot, height)
    if os.environ.get("TFORMER_SCREENSHOT"):
        shutil.copy(shot, os.environ["TFORMER_SCREENSHOT"])
