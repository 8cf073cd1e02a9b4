"""`python -m trainer.node_health`: is this node fit to train? (the warm spares' check).

A stable entry point: rendered manifests and running jobs' pod specs carry this command, so it keeps working
when the code behind it moves. The code is trainer.resilience.health; import that, not this."""

import sys

from trainer.resilience.health import main

if __name__ == "__main__":
    sys.exit(main())
