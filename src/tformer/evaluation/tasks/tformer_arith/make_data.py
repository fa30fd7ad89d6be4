"""Writes arith.jsonl: 50 four-way multiple-choice questions on small sums, differences and products (written
for tformer's lm-eval check, issue 53; run from the repository root). Each wrong choice is the answer off by
1, 2 or 10, so a model must do the arithmetic, not spot the only plausible number."""

import json, random
rng = random.Random(53)
items = []
ops = [("plus", lambda a, b: a + b), ("minus", lambda a, b: a - b), ("times", lambda a, b: a * b)]
while len(items) < 50:
    name, f = ops[len(items) % 3]
    a, b = rng.randint(2, 12), rng.randint(2, 12)
    if name == "minus" and b > a:
        a, b = b, a
    right = f(a, b)
    wrong = sorted({right + 1, right - 1, right + 10, right + 2, right - 2} - {right})
    distract = rng.sample([w for w in wrong if w >= 0], 3)
    choices = distract + [right]
    rng.shuffle(choices)
    items.append({"question": f"What is {a} {name} {b}?", "choices": [str(c) for c in choices],
                  "answer": choices.index(right)})
with open("src/tformer/evaluation/tasks/tformer_arith/arith.jsonl", "w") as fh:
    for it in items:
        fh.write(json.dumps(it) + "\n")
