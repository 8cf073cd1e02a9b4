"""The composition root of one training process: the start-up that builds every collaborator under its
phase (startup.py), the loop and the resume (trainer.py), the command line (cli.py). Only the entry points
(`python -m trainer`) and the fork server import it."""
