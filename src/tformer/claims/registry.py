"""Finding the claims: every module of ``tformer.claims.catalog`` that defines ``CLAIM``.

Adding a claim is adding one file there; nothing else lists them.
"""

from __future__ import annotations

import importlib
import pkgutil

from tformer.claims.base import Claim
from tformer.errors import InputError


def all_claims() -> list[Claim]:
    """Every claim, in ``order``. Raises if two share a name."""
    import tformer.claims.catalog as catalog

    claims = []
    for info in sorted(pkgutil.iter_modules(catalog.__path__), key=lambda i: i.name):
        module = importlib.import_module(f"{catalog.__name__}.{info.name}")
        if isinstance(getattr(module, "CLAIM", None), Claim):
            claims.append(module.CLAIM)
    names = [c.name for c in claims]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"claim name(s) {', '.join(duplicates)} defined twice in tformer/claims/catalog; rename one.")
    return sorted(claims, key=lambda c: (c.order, c.name))


def get_claims(names: list[str] | None = None) -> list[Claim]:
    """The claims called ``names`` (all of them for none or an empty list), in ``order``."""
    claims = all_claims()
    if not names:
        return claims
    known = {c.name: c for c in claims}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise InputError(f"unknown claim(s) {', '.join(unknown)}; run `tformer claims` to list them "
                         f"({', '.join(known)}).")
    return [c for c in claims if c.name in names]


def module_file(claim: Claim) -> str:
    """The source file that defines ``claim`` (its code is part of the cache key)."""
    import sys

    return sys.modules[claim.run.__module__].__file__
