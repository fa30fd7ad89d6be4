"""Claims of the transformer story as runnable experiments, with the paper's numbers beside ours.

A claim is one file under ``tformer/claims/catalog/`` that defines ``CLAIM = Claim(...)``: the sentence
it tests, its source and published figures, checks fixed before running (the verdict follows from
them mechanically), an experiment at two sizes and a plot. :func:`all_claims` finds every such file;
:func:`tformer.claims.runner.run_claims` runs them, caches results and writes the HTML report.
"""

from tformer.claims.base import VERDICTS, Check, Claim, verdict_of
from tformer.claims.registry import all_claims, get_claims

__all__ = ["VERDICTS", "Check", "Claim", "verdict_of", "all_claims", "get_claims"]
