"""The ListOps generator: labels from the tree equal a stack evaluation of the token string, a
hand-checked example, lengths within bounds, reproducible, all ten classes present."""

import random

from tformer.training.tasks.listops import VOCAB, evaluate, generate, tokens, tree, value


def test_hand_checked_example():
    toks = "[MAX 4 3 [MIN 2 3 ] 1 0 [MED 1 5 8 9 2 ] ]".split()
    assert evaluate(toks) == 5                       # MIN(2,3)=2, MED(1,5,8,9,2)=5, MAX(4,3,2,1,0,5)=5
    assert evaluate("[SM 9 8 [MED 1 2 3 4 ] ]".split()) == (9 + 8 + 2) % 10


def test_tree_value_equals_stack_evaluation():
    rng = random.Random(0)
    for _ in range(300):
        t = tree(rng, 0, 5, 5, 0.3)
        assert value(t) == evaluate(tokens(t))


def test_generated_set_is_bounded_reproducible_and_covers_the_classes():
    a = generate(200, seed=1, max_depth=4, max_args=5, min_len=20, max_len=120)
    assert a == generate(200, seed=1, max_depth=4, max_args=5, min_len=20, max_len=120)
    assert all(20 <= len(ids) <= 120 and ids[0] == VOCAB.index("<cls>") for ids, _ in a)
    assert {label for _, label in a} == set(range(10))
