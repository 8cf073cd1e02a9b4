"""`python -m trainer`: every process of the trainer watches its parent, then the command line runs."""

import sys

from trainer.cli import main
from trainer.parent_watch import die_with_parent

# Module level on purpose: DCP's writer and NVRx's workers start with `spawn`, which re-imports this module
# (as __mp_main__) in each child, so every process of the trainer — worker or writer — watches its parent.
die_with_parent()

# The guard matters: the spawned children must not run main().
if __name__ == "__main__":
    sys.exit(main())
