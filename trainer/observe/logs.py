"""The project's one log format, for every process: the pipeline's steps, the launchers and each rank."""

from __future__ import annotations

import logging

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure(level: int = logging.INFO, rank: int | None = None) -> None:
    """Log to stderr in the shared format; a rank's lines say which rank (only rank 0 logs progress)."""
    log_format = LOG_FORMAT if rank is None else LOG_FORMAT.replace("%(asctime)s", f"%(asctime)s [rank {rank}]", 1)
    logging.basicConfig(level=level, force=True, format=log_format)
