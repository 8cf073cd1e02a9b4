"""`python -m trainer.rendezvous_store`: the job's rendezvous store, outside every training node.

A stable entry point: rendered manifests and running jobs' pod specs carry this command, so it keeps working
when the code behind it moves. The code is trainer.launch.rendezvous_store; import that, not this."""

import sys

from trainer.launch.rendezvous_store import main

if __name__ == "__main__":
    sys.exit(main())
