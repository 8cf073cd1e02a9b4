"""`python -m trainer.lighthouse`: torchft's lighthouse for a TrainJob's replica groups (the runtime's pod).

A stable entry point: rendered manifests and running jobs' pod specs carry this command, so it keeps working
when the code behind it moves. The code is trainer.launch.lighthouse; import that, not this."""

import sys

from trainer.launch.lighthouse import main

if __name__ == "__main__":
    sys.exit(main())
