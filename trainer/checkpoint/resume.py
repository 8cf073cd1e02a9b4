"""Where a run resumes from: the newest valid copy among the tiers, and which tier it came from.

    step, source, saved_step = choose_and_load(state, ...)   # collective; fills `state` in place

Nearest first: node memory (and its replica on a peer node; trainer.checkpoint.memory) unless FSx holds
something newer that verifies, the newest FSx checkpoint whose files have their manifest's sizes (its hashes
checked as it is read), an S3 copy brought back onto FSx when S3 holds something newer (trainer.checkpoint.
s3_tier). A corrupt or partial copy at any tier is skipped with a log line and the next one is tried.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from trainer.checkpoint.format import CheckpointError, committed_checkpoints, latest_valid_checkpoint
from trainer.checkpoint.load import load_checkpoint
from trainer.checkpoint.memory import MemoryTier
from trainer.checkpoint.s3_tier import S3Tier
from trainer.run.events import EventLog

log = logging.getLogger(__name__)


class ResumeChoice:
    """Collective: every method runs on every rank; rank 0 looks at the shared folders and tells the others.
    `prefetch`: this start's RestorePrefetch (trainer.checkpoint.prefetch), if any; `phase(tier)`: the restore
    tiers as start-up phases (trainer.resilience.phases)."""

    def __init__(self, directory: Path, *, rank: int, events: EventLog, memory: MemoryTier | None,
                 s3: S3Tier | None, prefetch=None, phase: Callable[[str], Any] | None = None):
        self._directory, self._rank, self._events = Path(directory), rank, events
        self._memory, self._s3, self._prefetch = memory, s3, prefetch
        self._phase = phase or (lambda tier: nullcontext())
        self._at_most: int | None = None  # the load in progress takes no later step (a rollback)

    def load_latest(self, state: dict[str, Any], at_most: int | None = None) -> tuple[int, str, int | None]:
        """Fill `state` from the newest valid copy: (step, source, the newest FSx checkpoint's step to count as
        saved). source: "memory" (every rank's node memory), "peer" (some rank's copy came from its peer's
        replica), "disk" (the newest FSx checkpoint that verifies), "s3" (a copy downloaded because nothing
        nearer is as new), or "none" (step 0, state untouched). Rank 0 records a `resume` event either way.
        at_most: no copy of a later step is taken (a rollback: trainer.job.numeric_recovery)."""
        rejected: set[Path] = set()  # FSx folders that failed verification while loading: never tried again
        self._at_most = at_most
        while (resumed := self._load_newest(state, rejected)) is None:
            pass
        return resumed

    def _load_newest(self, state: dict[str, Any], rejected: set[Path]) -> tuple[int, str, int | None] | None:
        """One attempt; None when the FSx checkpoint chosen did not verify (now in `rejected`)."""
        newest_committed = self._newest_committed_step()
        path = disk_step = None
        at_most = self._at_most
        if self._memory is not None:
            # Memory wins unless FSx holds something newer that verifies (FSx is hashed only then).
            with self._phase("restore_memory"):
                found = self._memory.restore_newest(state, newer_than=(newest_committed or 0) - 1, at_most=at_most)
            if found is None and newest_committed is not None:
                path, disk_step = self._find_latest(rejected)
                with self._phase("restore_memory"):
                    found = self._memory.restore_newest(state, newer_than=disk_step - 1 if path is not None else -1,
                                                        at_most=at_most)
            if found is not None:
                return self._resumed(*found, None, disk_step if path is not None else newest_committed)
        if path is None:
            path, disk_step = self._find_latest(rejected)
        source = "disk"
        if self._s3 is not None:
            with self._phase("restore_s3"):
                fetched = self._fetch_from_s3(newer_than=disk_step)
            if fetched is not None:
                (path, disk_step), source = fetched, "s3"
        if path is None:
            return self._resumed(0, "none", None, None)
        try:
            prehashed = self._prefetch.verified_files(path) if self._prefetch is not None else set()
            with self._phase("restore_fsx"):
                # verifies as it reads; per-rank RNG, the sample position and the LR schedule only where the
                # checkpoint has them (a checkpoint of an earlier release)
                stats = load_checkpoint(state, path, optional=("rng", "data", "schedule"), prehashed=prehashed)
        except CheckpointError as err:  # raised on every rank alike: DCP gathers every rank's read errors
            log.warning("skipping checkpoint %s (step %s): %s", path, disk_step, err)
            if self._rank == 0:
                self._events.write("checkpoint_rejected", step=disk_step, path=str(path), error=str(err))
            rejected.add(path)
            return None
        log.info("resumed from %s (%.1f MB read, %d files verified here)", path, stats["bytes_read"] / 1e6,
                 stats["files_verified"])
        return self._resumed(disk_step, source, path, disk_step)

    def _resumed(self, step: int, source: str, path: Path | None, saved_step: int | None) -> tuple[int, str, int | None]:
        if self._rank == 0:
            self._events.write("resume", step=step, source=source, path=str(path) if path is not None else None,
                               **({"at_most": self._at_most} if self._at_most is not None else {}))
        return step, source, saved_step

    def _fetch_from_s3(self, newer_than: int | None) -> tuple[Path, int] | None:
        """Rank 0 brings back the newest S3 copy newer than what FSx holds (it downloads onto the shared FSx
        folder), and every rank learns its path."""
        choice: list = [None, None]
        if self._rank == 0:
            self._directory.mkdir(parents=True, exist_ok=True)
            found = self._s3.restore_newest(self._directory, newer_than, self._at_most)
            if found is not None:
                choice = [str(found[0]), found[1]]
        dist.broadcast_object_list(choice, src=0)
        return (Path(choice[0]), choice[1]) if choice[0] is not None else None

    def _newest_committed_step(self) -> int | None:
        """The step of the newest committed folder, unverified (cheap: a directory listing)."""
        found = [(step, folder) for step, folder in committed_checkpoints(self._directory)
                 if self._at_most is None or step <= self._at_most] if self._rank == 0 else []
        choice = [found[-1][0] if found else None]
        dist.broadcast_object_list(choice, src=0)
        return choice[0]

    def _find_latest(self, rejected: set[Path]) -> tuple[Path | None, int | None]:
        """The newest checkpoint not in `rejected` whose files have their manifest's sizes, and its step
        ((None, None): none). The load itself checks the content hashes."""
        later = {folder for step, folder in committed_checkpoints(self._directory)
                 if self._at_most is not None and step > self._at_most} if self._rank == 0 else set()
        found = (latest_valid_checkpoint(self._directory, hash_files=False, exclude=rejected | later)
                 if self._rank == 0 else None)
        choice = [str(found.path) if found else None, int(found.manifest["step"]) if found else None]
        dist.broadcast_object_list(choice, src=0)
        if choice[0] is None:
            return None, None
        if not Path(choice[0]).is_dir():
            raise RuntimeError(f"rank {self._rank} does not see the checkpoint rank 0 chose ({choice[0]}): "
                               "is the checkpoint directory on a shared file system?")
        return Path(choice[0]), choice[1]
