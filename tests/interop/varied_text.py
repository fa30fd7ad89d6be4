"""Varied text for tokenizer tests: code, Unicode of many scripts, digits, whitespace runs, contractions."""

from __future__ import annotations

import random

WORDS = ("the sea and its waves under a grey sky, while ships sail home to the harbour before night falls "
         "Hello World Transformer attention is all you need").split()
CONTRACTIONS = ["don't", "I'M", "we'll", "it's", "they've", "She'd", "you're", "O'Neil", "rock'n'roll", "'quoted'"]
CODE = ["def f(x):", "    return x**2 + 1", "for (int i = 0; i < n; ++i) {", "\tif x == y:", "{'a': [1, 2, 3]}",
        "std::vector<int> v;", '<div class="x">', "SELECT * FROM t WHERE id = 42;", "x -> y => z", "a_b.c(d)[e]",
        "#include <stdio.h>", "// comment", "/* block */", "$HOME/.cache", "~user", "@decorator", "λx.x", "0x1F",
        "if(a&&b||!c){}", "print(f'{x:>10}')", "s = \"\\n\\t\""]
UNICODE = ["café", "naïve", "Straße", "日本語のテキスト", "中文字符", "한국어", "Ελληνικά", "русский текст", "عربي",
           "हिन्दी", "🙂👍🏽🚀", "e\u0301", "ﬁne", "👩\u200d💻", "½ ² ³", "٣٤٥", "①②", "Ⅻ", "\u00a0nbsp", "—–…", "«»„“",
           "ǅ", "ſ", "Ω", "ℕ", "\u2028", "ทดสอบ", "עברית"]
SPACES = [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \t ", "    ", "\n   ", "\t\t", "        "]


def number(rng: random.Random) -> str:
    return rng.choice([str(rng.randint(0, 10 ** rng.randint(1, 9))), f"{rng.uniform(-1e4, 1e4):.{rng.randint(0, 6)}f}",
                       f"{rng.randint(1, 9)},{rng.randint(100, 999)},{rng.randint(100, 999)}",
                       f"{rng.randint(1900, 2100)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
                       f"+1 ({rng.randint(100, 999)}) {rng.randint(100, 999)}-{rng.randint(1000, 9999)}", "3.14159"])


def varied_lines(n: int = 2000, seed: int = 0) -> list[str]:
    """``n`` lines, each 3 to 12 random pieces joined by random whitespace (or nothing)."""
    rng = random.Random(seed)
    kinds = [lambda: rng.choice(WORDS), lambda: rng.choice(CONTRACTIONS), lambda: rng.choice(CODE),
             lambda: rng.choice(UNICODE), lambda: number(rng), lambda: rng.choice(SPACES),
             lambda: rng.choice(WORDS).upper(), lambda: rng.choice("!?.,;:()[]{}<>\"'`-_=+*/\\|&^%$#@~")]
    lines = []
    for _ in range(n):
        pieces = [rng.choice(kinds)() for _ in range(rng.randint(3, 12))]
        line = "".join(p + rng.choice(["", " ", " ", "  ", "\n", "\t"]) for p in pieces)
        lines.append(line if rng.random() < 0.8 else rng.choice(SPACES) + line + rng.choice(SPACES))
    return lines
