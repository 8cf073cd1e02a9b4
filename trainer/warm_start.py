"""`python -m trainer.warm_start`: a node's fork server, started by its launcher (trainer.launch.warm_start).

A stable entry point: rendered manifests and running jobs' pod specs carry this command, so it keeps working
when the code behind it moves. Nothing else belongs here; import trainer.launch.warm_start instead."""

import sys

from trainer.launch.warm_start import serve

if __name__ == "__main__":
    serve(sys.argv[1])
