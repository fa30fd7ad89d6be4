"""The report: one self-contained HTML page (inline CSS, plots as base64 PNG, no script, no CDN)
and a markdown table of the same results.

The plots go in as palette PNGs (256 colours, one byte a pixel instead of four): a line plot holds a few
dozen distinct colours plus their anti-aliasing ramps, so the quantised image looks the same and the page
is a fraction of the size (the RGBA plots of 19 claims are about 1 MB of base64).
"""

from __future__ import annotations

import html
import io

from tformer.claims.common import png_data_uri

CSS = """
body{font:15px/1.5 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;background:#f6f7f9;color:#1d232b}
main{max-width:1080px;margin:0 auto;padding:24px}
h1{margin:0 0 4px}h2{margin:0 0 8px;font-size:1.3em}
.meta{color:#5a6470;font-size:.9em}
table{border-collapse:collapse;width:100%;margin:8px 0;background:#fff}
th,td{border:1px solid #d8dde3;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#eef1f4}
.claim{background:#fff;border:1px solid #d8dde3;border-radius:8px;padding:16px 20px;margin:20px 0}
.sentence{font-size:1.05em;border-left:4px solid #8aa4c8;margin:8px 0;padding:2px 12px;background:#f3f6fa}
.verdict{display:inline-block;padding:2px 10px;border-radius:12px;font-weight:600;font-size:.9em}
.verdict-reproduced{background:#d9f2de;color:#145a24}
.verdict-partly{background:#fff1c9;color:#6b4e00}
.verdict-not-reproduced{background:#fbdada;color:#7a1616}
.verdict-error{background:#7a1616;color:#fff}
.verdict-unavailable,.verdict-not-run{background:#e3e6ea;color:#3a424c}
pre.error{background:#fbdada;padding:8px;overflow-x:auto;font-size:.85em}
.pass{color:#145a24}.fail{color:#7a1616}
img.plot{max-width:100%;height:auto;border:1px solid #eee;margin-top:8px}
ul.checks{padding-left:20px;margin:4px 0}
"""


def palette_png(png: bytes, colours: int = 256) -> bytes:
    """``png`` re-encoded as an 8-bit palette PNG: composited on white (the plots are opaque anyway), then
    quantised by median cut to ``colours`` entries without dithering (dithering adds noise that compresses
    badly); the original is returned when it is already smaller (or empty)."""
    if not png:
        return png
    from PIL import Image

    image = Image.open(io.BytesIO(png))
    if image.mode != "RGB":
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        image = Image.alpha_composite(white, image.convert("RGBA")).convert("RGB")
    out = io.BytesIO()
    image.quantize(colours, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(out, "PNG", optimize=True)
    return out.getvalue() if out.tell() < len(png) else png


def _e(x) -> str:
    return html.escape(str(x))


def _verdict(v: str) -> str:
    slug = v.replace(" ", "-")
    return f'<span class="verdict verdict-{slug}" data-verdict="{_e(v)}">{_e(v)}</span>'


def _section(c: dict, png: bytes) -> str:
    rows = "".join(f"<tr><td>{_e(q)}</td><td>{_e(p)}</td><td>{_e(o)}</td></tr>" for q, p, o in c["rows"])
    published = "".join(f"<li>{_e(q)}: {_e(v)}</li>" for q, v in c["published"])
    checks = "".join(
        f'<li class="{"pass" if k["passed"] else "fail"}">{"✓" if k["passed"] else "✗"} {_e(k["what"])}'
        f' <span class="meta">({_e(k["detail"])})</span></li>' for k in c["checks"])
    notes = f'<p class="notes"><b>Setting.</b> {_e(c["notes"])}</p>' if c["notes"] else ""
    origin = "cached result" if c["cached"] else "measured in this run"
    figure = (f'<img class="plot" alt="plot for {_e(c["name"])}" src="{png_data_uri(palette_png(png))}">' if png else
              f'<pre class="error">{_e(c.get("error", ""))}</pre>')
    return f"""
<section class="claim" id="claim-{_e(c['name'])}" data-claim="{_e(c['name'])}">
  <h2>{_e(c['title'])} {_verdict(c['verdict'])}</h2>
  <p class="sentence">{_e(c['sentence'])}</p>
  <p><b>Source.</b> {_e(c['source'])}</p>
  <p><b>Published.</b></p><ul class="published">{published}</ul>
  <table class="rows"><tr><th>quantity</th><th>published</th><th>tformer (measured here)</th></tr>{rows}</table>
  <p><b>Criterion</b> (fixed before running; all pass: reproduced, some: partly, none: not reproduced):</p>
  <ul class="checks">{checks}</ul>
  {notes}
  {figure}
  <p class="meta">{_e(c['size'])} size, {origin} ({_e(c['date'])}, {c['seconds']:.1f} s{_claim_load(c)});
  code hash {_e(c['code_hash'])}; config {_e(c['config'])}</p>
</section>"""


def _claim_load(c: dict) -> str:
    m = c.get("machine") or {}
    if "busy_cores_before" not in m:
        return f", {m['threads']} threads" if "threads" in m else ""
    return (f", {m['threads']} threads; other processes kept {m['busy_cores_before']:.1f} / {m['busy_cores_after']:.1f} "
            f"cores busy before / after, load average {m['load_average']}")


def render_html(results: dict, pngs: list[bytes]) -> str:
    """The whole page: a summary table, then one section per claim."""
    summary = "".join(
        f'<tr><td><a href="#claim-{_e(c["name"])}">{_e(c["name"])}</a></td><td>{_e(c["title"])}</td>'
        f'<td>{_verdict(c["verdict"])}</td></tr>' for c in results["claims"])
    sections = "".join(_section(c, png) for c, png in zip(results["claims"], pngs))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>tformer claims</title><style>{CSS}</style></head>
<body><main>
<h1>tformer claims</h1>
<p class="meta">{_e(results['size'])} size · generated {_e(results['generated'])} · {_e(results['cpu'])}
({_e(', '.join(results.get('instruction_sets', [])))}), {results['cores']} cores, {results.get('threads', '?')} torch
threads · torch {_e(results['torch'])} · {_machine_load(results)}.
Each claim: the published figures, ours, the verdict from checks fixed before running, and a plot.</p>
<table class="summary"><tr><th>claim</th><th>what</th><th>verdict</th></tr>{summary}</table>
{sections}
</main></body></html>
"""


def _machine_load(results: dict) -> str:
    if results.get("cached_only"):
        return (f"assembled from cached results (each claim's own load is in its section); other processes kept "
                f"{results['busy_cores_before']:.1f} of {results['cores']} cores busy while assembling")
    return (f"other processes kept {results['busy_cores_before']:.1f} of {results['cores']} cores busy before the "
            f"run and {results['busy_cores_after']:.1f} after (load average {results['load_average']})")


def render_markdown(results: dict) -> str:
    """One table row per claim comparison, with the verdict; for docs and the README."""
    lines = [f"Generated {results['generated']} ({results['size']} size) on {results['cpu']} "
             f"({', '.join(results.get('instruction_sets', []))}), {results['cores']} cores, "
             f"{results.get('threads', '?')} torch threads, torch {results['torch']}; {_machine_load(results)}.", "",
             "| claim | quantity | published | tformer | verdict |", "|---|---|---|---|---|"]
    for c in results["claims"]:
        empty = ([("not measured", "", c.get("error", "").split(";")[0])] if c["verdict"] in ("not run", "unavailable")
                 else [("the claim's code failed", "", "see index.html")])
        for i, (q, p, o) in enumerate(c["rows"] or empty):
            first = i == 0
            cells = [c["name"] if first else "", q, p, o, c["verdict"] if first else ""]
            lines.append("| " + " | ".join(str(x).replace("|", "\\|") for x in cells) + " |")
    loads = [f"{c['name']} {c['machine']['busy_cores_before']:.1f}/{c['machine']['busy_cores_after']:.1f}"
             f" (load {c['machine']['load_average']})" for c in results["claims"]
             if "busy_cores_before" in (c.get("machine") or {})]
    if loads:
        lines += ["", "Cores other processes kept busy before/after each claim's own measurement: " + ", ".join(loads) + "."]
    lines += ["", "Time per claim (s): " + ", ".join(
        f"{c['name']} {c['seconds']:.0f}{' (cached)' if c['cached'] else ''}" for c in results["claims"])
        + f"; total {sum(c['seconds'] for c in results['claims']):.0f} s.", "",
        "Code hashes: " + ", ".join(f"{c['name']} {c['code_hash']}" for c in results["claims"]) + "."]
    return "\n".join(lines) + "\n"
