"""`python -m trainer.export`: a checkpoint exported as a Hugging Face model.

A stable entry point: rendered manifests and running jobs' pod specs carry this command, so it keeps working
when the code behind it moves. The code is trainer.checkpoint.export; import that, not this."""

import sys

from trainer.checkpoint.export import main

if __name__ == "__main__":
    sys.exit(main())
