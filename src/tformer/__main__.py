"""``python -m tformer``: the same as the ``tformer`` command."""

import sys

from tformer.cli import main

sys.exit(main())
