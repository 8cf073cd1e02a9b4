"""The smallest FSx for Lustre file system a job's checkpoints need (the rules: trainer.config.fsx)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterator

from trainer.config.fsx import FIRST_STEPS_GIB, PERSISTENT_2_MBPS_PER_TIB, STEP_GIB


@dataclass(frozen=True)
class FileSystemSize:
    deployment_type: str
    storage_gib: int
    per_unit_mbps_per_tib: int
    throughput_mbps: float


def storage_sizes() -> Iterator[int]:
    """Every storage size FSx offers, smallest first."""
    yield from FIRST_STEPS_GIB
    yield from itertools.count(2 * STEP_GIB, STEP_GIB)


def smallest_persistent_2(min_bytes: float, min_mbps: float) -> FileSystemSize:
    """The PERSISTENT_2 file system of the least storage that holds `min_bytes`, at the lowest tier that gives
    `min_mbps`; more storage only when even the highest tier is too slow for the least."""
    for gib in storage_sizes():
        if gib * 2**30 < min_bytes:
            continue
        for tier in PERSISTENT_2_MBPS_PER_TIB:
            if gib / 1024 * tier >= min_mbps:
                return FileSystemSize("PERSISTENT_2", gib, tier, gib / 1024 * tier)
    raise AssertionError("unreachable: storage_sizes() never ends")


def checkpoint_needs(state_bytes: float, keep_last: int, interval_seconds: float, base_model_bytes: float = 0.0,
                     ) -> tuple[float, float]:
    """(bytes, MB/s) the checkpoints need: keep_last committed ones, one being written and the base model held;
    a checkpoint written within its interval at half the file system's throughput (the other half: the S3 upload
    reading a committed one, a resume's read, the data loader)."""
    return (keep_last + 1) * state_bytes + base_model_bytes, 2 * state_bytes / 1e6 / max(interval_seconds, 1e-9)
