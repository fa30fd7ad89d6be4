"""``python -m tformer``: the ``tformer`` command, also as torchrun's entry point
(``torchrun --nproc-per-node N -m tformer train ...``).

``record`` writes an uncaught exception of a rank to the error file torchrun names, so torchrun's
summary of a failed job shows that rank's message, not only its exit code.
"""

import sys

from torch.distributed.elastic.multiprocessing.errors import record

from tformer.cli import main

if __name__ == "__main__":
    sys.exit(record(main)())
