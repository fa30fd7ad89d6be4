"""torchrun entry point for tests/training/test_distributed.py: `tformer` whose rank 1 raises at step 3.

Rank 0 is then waiting for rank 1 in the step's gradient all-reduce; the job must still end, with
rank 1's message. Not a test module (pytest collects test_*.py only).
"""

import sys

from torch.distributed.elastic.multiprocessing.errors import record

from tformer.cli import main
from tformer.training.trainer import Trainer

_train_step = Trainer._train_step


def _failing_step(self, lr):
    if self.dist.rank == 1 and self.step == 3:
        raise RuntimeError("injected failure on rank 1 at step 3")
    return _train_step(self, lr)


Trainer._train_step = _failing_step

if __name__ == "__main__":
    sys.exit(record(main)(sys.argv[1:]))
