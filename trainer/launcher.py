"""`python -m trainer.launcher`: a node's launcher (ft_launcher or torchrun under the node's lifetime rules).

A stable entry point: rendered manifests and running jobs' pod specs carry this command, so it keeps working
when the code behind it moves. The code is trainer.launch.launcher; import that, not this."""

import sys

from trainer.launch.launcher import main

if __name__ == "__main__":
    main(sys.argv[1:])
