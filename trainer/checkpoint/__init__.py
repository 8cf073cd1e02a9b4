"""Checkpoints: the format (format.py), the write backends (backends.py), the manager that saves, commits
and decides where a run resumes from (manager.py), and the in-memory copy of in-process restarts (memory.py).
Import the submodule you need: the format is light, the manager and backends import torch."""
