"""What a claim is: a sentence, its source, checks fixed before running, an experiment, a plot.

The verdict is never written by hand. A claim's ``checks(measured)`` returns a list of
:class:`Check` (each with the threshold in its wording, fixed in the claim's file before any run);
:func:`verdict_of` turns them into ``reproduced`` (every check passes), ``partly`` (some do) or
``not reproduced`` (none does). Changing a threshold changes the file, so the cache key and the
report's code hash change with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

VERDICTS = ("reproduced", "partly", "not reproduced")
SIZES = ("quick", "full")


@dataclass(frozen=True)
class Check:
    """One criterion: ``what`` states the test with its threshold, ``detail`` the measured value."""

    what: str
    passed: bool
    detail: str = ""


def verdict_of(checks: list[Check]) -> str:
    """All checks pass: reproduced; some: partly; none: not reproduced."""
    passed = sum(c.passed for c in checks)
    if checks and passed == len(checks):
        return "reproduced"
    return "partly" if passed else "not reproduced"


@dataclass(frozen=True)
class Claim:
    """One claim of the literature and the experiment that tests it.

    Args:
        name: short identifier used on the command line (``sqrt-dk``).
        order: position in listings and the report.
        title: a few words.
        sentence: the claim, as one sentence.
        source: paper, table or figure.
        published: the published figures (``(quantity, value)`` pairs), quoted, never measured here.
        sizes: ``{"quick": config, "full": config}``; the config is a JSON-able dict passed to ``run``.
        run: ``run(config, progress) -> measured`` (a JSON-able dict); ``progress(iterable, desc)``
            wraps a loop in a nested progress bar.
        checks: ``checks(measured) -> [Check]``, the criterion (fixed before running).
        rows: ``rows(measured) -> [(quantity, published, ours)]`` for the report's comparison table.
        plot: ``plot(measured) -> matplotlib Figure``.
        notes: what differs from the paper's setting (scale, data, architecture).
    """

    name: str
    order: int
    title: str
    sentence: str
    source: str
    published: list[tuple[str, str]]
    sizes: dict[str, dict[str, Any]]
    run: Callable[[dict, Callable], dict]
    checks: Callable[[dict], list[Check]]
    rows: Callable[[dict], list[tuple[str, str, str]]]
    plot: Callable[[dict], Any]
    notes: str = ""

    def __post_init__(self) -> None:
        missing = [s for s in SIZES if s not in self.sizes]
        if missing:
            raise ValueError(f"claim {self.name!r} has no {', '.join(missing)} size; "
                             f"define sizes['quick'] and sizes['full'].")
