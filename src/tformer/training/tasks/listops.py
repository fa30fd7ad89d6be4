"""ListOps (Nangia & Bowman, 2018), the Long Range Arena's first task, generated here (nothing downloaded).

An expression is a nested list of operators over digits 0-9, its label the value (10 classes)::

    [MAX 4 3 [MIN 2 3 ] 1 0 [MED 1 5 8 9 2 ] ]   ->   5

Operators: ``MIN``, ``MAX``, ``MED`` (the median; for an even count, the lower of the two middle
values), ``SM`` (sum modulo 10). The generator follows the LRA rules: from the root, each argument
is a digit with probability ``value_p`` (0.25 in LRA) or else a new operator list, up to ``max_depth``
levels (10 in LRA), 2..``max_args`` arguments each (10 in LRA); sequences are kept when their length
lies in ``[min_len, max_len]`` (LRA: 500..2000 tokens). Smaller settings give a CPU-sized variant.
"""

from __future__ import annotations

import random
import statistics

OPS = ("MIN", "MAX", "MED", "SM")
VOCAB = ["<pad>", "<cls>", "]", *[f"[{op}" for op in OPS], *[str(d) for d in range(10)]]
TOKEN_ID = {t: i for i, t in enumerate(VOCAB)}


def apply(op: str, args: list[int]) -> int:
    """The value of one operator over its argument values."""
    if op == "MIN":
        return min(args)
    if op == "MAX":
        return max(args)
    if op == "MED":
        return statistics.median_low(args)
    return sum(args) % 10


def tree(rng: random.Random, depth: int, max_depth: int, max_args: int, value_p: float):
    """A random expression: an int, or ``(op, [children])``."""
    if depth > 0 and (depth >= max_depth or rng.random() < value_p):
        return rng.randrange(10)
    return rng.choice(OPS), [tree(rng, depth + 1, max_depth, max_args, value_p)
                             for _ in range(rng.randint(2, max_args))]


def tokens(t) -> list[str]:
    """``[OP a b ... ]`` as a token list."""
    if isinstance(t, int):
        return [str(t)]
    op, children = t
    return [f"[{op}", *[s for c in children for s in tokens(c)], "]"]


def value(t) -> int:
    """The label, evaluated recursively on the tree."""
    return t if isinstance(t, int) else apply(t[0], [value(c) for c in t[1]])


def evaluate(toks: list[str]) -> int:
    """The label, evaluated from the token string with a stack (a second, independent evaluator)."""
    stack: list[list] = []
    result = None
    for tok in toks:
        if tok.startswith("["):
            stack.append([tok[1:]])
        elif tok == "]":
            op, *args = stack.pop()
            result = apply(op, args)
            if stack:
                stack[-1].append(result)
        elif stack:
            stack[-1].append(int(tok))
        else:                                                                # a bare digit
            result = int(tok)
    return result


def generate(n: int, *, seed: int = 0, max_depth: int = 10, max_args: int = 10, value_p: float = 0.25,
             min_len: int = 500, max_len: int = 2000) -> list[tuple[list[int], int]]:
    """``n`` examples ``(token ids with a leading <cls>, label)``, lengths in ``[min_len, max_len]``."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        t = tree(rng, 0, max_depth, max_args, value_p)
        toks = tokens(t)
        if min_len <= len(toks) + 1 <= max_len:
            out.append(([TOKEN_ID["<cls>"], *[TOKEN_ID[s] for s in toks]], value(t)))
    return out
