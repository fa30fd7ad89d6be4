"""The report's palette PNGs: the same picture as the plot's RGBA PNG, in fewer bytes."""

import io

import numpy as np
from PIL import Image

from tformer.claims.common import figure_png, new_figure
from tformer.claims.report import palette_png


def _plot_png() -> bytes:
    fig, (a, b) = new_figure(2, width=3.0)
    x = np.linspace(0, 6, 200)
    for k in range(6):                                   # several colours, anti-aliased lines, text
        a.plot(x, np.sin(x + k), label=f"curve {k}")
    a.legend(fontsize=6)
    b.bar(["a", "b", "c"], [3, 1, 2], color="C0")
    b.set(title="bars", xlabel="kind")
    return figure_png(fig)


def test_palette_png_is_the_same_picture_in_fewer_bytes():
    rgba = _plot_png()
    small = palette_png(rgba)
    before, after = Image.open(io.BytesIO(rgba)), Image.open(io.BytesIO(small))
    assert after.mode == "P" and after.size == before.size
    assert len(after.getpalette()) // 3 <= 256
    ref = np.asarray(Image.alpha_composite(Image.new("RGBA", before.size, "white"), before.convert("RGBA"))
                     .convert("RGB"), dtype=float)
    got = np.asarray(after.convert("RGB"), dtype=float)
    diff = np.abs(got - ref)
    # median cut keeps the plot's few flat colours exactly; only anti-aliasing ramps move a little
    assert diff.mean() < 1.0, diff.mean()
    assert np.quantile(diff.max(axis=-1), 0.99) < 24, np.quantile(diff.max(axis=-1), 0.99)
    assert len(small) < 0.7 * len(rgba), (len(small), len(rgba))


def test_palette_png_passes_empty_and_smaller_input_through():
    assert palette_png(b"") == b""
    tiny = io.BytesIO()
    Image.new("P", (4, 4)).save(tiny, "PNG")
    assert len(palette_png(tiny.getvalue())) <= len(tiny.getvalue())     # never larger than what it was given
