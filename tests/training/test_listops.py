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


def test_task_batches_follow_epochs_of_one_shuffling_generator():
    """Step s's batch is the one an endless epoch-by-epoch shuffle (one generator) gives at s, in any order of asking."""
    import torch

    from tformer.training.tasks.listops import ListOpsTask, collate

    data = generate(50, seed=3, max_depth=3, max_args=3, min_len=5, max_len=40)
    rng, stream = torch.Generator().manual_seed(7), []
    for _ in range(3):                                            # the reference: 3 epochs of 6 batches of 8
        order = torch.randperm(len(data), generator=rng)
        stream += [collate([data[i] for i in order[s:s + 8]], 40) for s in range(0, 48, 8)]
    task = ListOpsTask(data, 8, 40, seed=7)
    for step in (13, 2, 17, 0, 6):
        assert all(torch.equal(a, b) for a, b in zip(task.batch(step), stream[step]))


def test_classifier_trains_through_the_loop(one_thread):
    import math

    from tformer.training.tasks.listops import train_classifier

    kw = dict(max_depth=2, max_args=3, min_len=4, max_len=32)
    train, test = generate(256, seed=1, **kw), generate(64, seed=2, **kw)
    model, acc, loss, seconds = train_classifier("attention", None, train, test, 30, length=32, batch_size=16)
    assert 0 <= acc <= 100 and math.isfinite(loss) and loss < math.log(10) and not model.training
