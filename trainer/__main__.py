"""`python -m trainer`: every process of the trainer watches its parent, then the command line runs — in a
fork of the node's warm server when the launcher started one (trainer.warm_start), else here."""

import os
import sys

from trainer.env import WARM_START_ENV
from trainer.launch.parent_watch import die_with_parent
from trainer.launch.warm_start import run_in_fork_server

# Module level on purpose: DCP's writer and NVRx's workers start with `spawn`, which re-imports this module
# (as __mp_main__) in each child, so every process of the trainer — worker or writer — watches its parent.
die_with_parent()

# The guard matters: the spawned children must not run main().
if __name__ == "__main__":
    code = run_in_fork_server(os.environ[WARM_START_ENV], sys.argv[1:]) if os.environ.get(WARM_START_ENV) else None
    if code is None:
        # Here, not at the top: a worker the warm server runs never pays these imports.
        from trainer.job.cli import main

        code = main()
    sys.exit(code)
