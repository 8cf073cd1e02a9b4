"""`python -m trainer.export`: a checkpoint exported as a Hugging Face model (trainer.checkpoint.export).

A stable entry point: rendered manifests and running jobs' pod specs carry this command, so it keeps working
when the code behind it moves. Nothing else belongs here; import trainer.checkpoint.export instead."""

import sys

from trainer.checkpoint.export import main

if __name__ == "__main__":
    sys.exit(main())
