"""`python -m trainer.warm_start`: a node's fork server, started by its launcher.

A stable entry point: rendered manifests and running jobs' pod specs carry this command, so it keeps working
when the code behind it moves. The code is trainer.launch.warm_start; import that, not this."""

import sys

from trainer.launch.warm_start import serve

if __name__ == "__main__":
    serve(sys.argv[1])
