"""`python -m trainer.node_health`: whether this node is fit to train (the warm spares' check) (trainer.launch.node_health).

A stable entry point: rendered manifests and running jobs' pod specs carry this command, so it keeps working
when the code behind it moves. Nothing else belongs here; import trainer.launch.node_health instead."""

import sys

from trainer.launch.node_health import main

if __name__ == "__main__":
    sys.exit(main())
