"""`python -m trainer.node_health`: is this node fit to train? (the warm spares' check).

A stable entry point: rendered manifests and running jobs' pod specs carry this command, so it keeps working
when the code behind it moves. The code is trainer.launch.node_health; import that, not this."""

import sys

from trainer.launch.node_health import main

if __name__ == "__main__":
    sys.exit(main())
