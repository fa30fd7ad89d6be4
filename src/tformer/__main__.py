"""``python -m tformer``: the same as the ``tformer`` command, also as torchrun's entry point
(``torchrun --nproc-per-node N -m tformer train ...``).

``record`` writes an uncaught exception of a rank to the error file torchrun names, so torchrun's
summary of a failed job shows that rank's message, not only its exit code (outside torchrun it
changes nothing).
"""

import sys

from torch.distributed.elastic.multiprocessing.errors import record

from tformer.cli import main

sys.exit(record(main)())
