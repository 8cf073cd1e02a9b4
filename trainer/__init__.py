"""FSDP2 training of Llama-architecture models, usable without KFP (the loop: trainer/job/trainer.py; the command line: trainer/job/cli.py)."""

import warnings

# torch imports pynvml on CPU-only builds too; the deprecation notice is noise in every rank's log.
warnings.filterwarnings("ignore", message="The pynvml package is deprecated", category=FutureWarning)
