"""Which FSx checkpoints stay: keep-last-k counting only checkpoints that verify, and what a crash left.

    retention = Retention(directory, keep_last=3)
    retention.remove_stale()          # at start-up: half-written saves, half-done deletions
    retention.apply(step)             # after each commit (rank 0)

A deletion renames the folder to ``step-N.deleting`` first, so a crash mid-way leaves a folder no reader
takes for a checkpoint (removed at the next start).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Callable

from trainer.checkpoint.format import MANIFEST, committed_checkpoints, stale_folders, verify_checkpoint

log = logging.getLogger(__name__)


def _no_hook(point: str, step: int) -> None:
    return None


class Retention:
    """save_point(point, step): the kill_during_retention drill's hook (trainer.resilience.faults)."""

    def __init__(self, directory: Path, keep_last: int, save_point: Callable[[str, int], object] = _no_hook):
        self._directory, self._keep_last, self._save_point = Path(directory), keep_last, save_point
        self._verified: dict[Path, tuple[int, bool]] = {}  # folder -> (manifest mtime, verified ok)

    def remove_stale(self) -> None:
        """At start-up no save of this job is in flight: what a crash left half-written or half-deleted goes."""
        for folder in stale_folders(self._directory):
            log.info("removing %s (left by an interrupted save or deletion)", folder)
            shutil.rmtree(folder, ignore_errors=True)

    def verified_now(self, folder: Path) -> None:
        """A folder just committed (hashed by its writer): no need to hash it again."""
        self._verified[folder] = ((folder / MANIFEST).stat().st_mtime_ns, True)

    def is_valid(self, folder: Path) -> bool:
        """Verified against its manifest, once per process per manifest (committed folders do not change)."""
        try:
            stamp = (folder / MANIFEST).stat().st_mtime_ns
        except FileNotFoundError:
            stamp = -1
        known = self._verified.get(folder)
        if known is None or known[0] != stamp:
            result = verify_checkpoint(folder)
            if not result.ok:
                log.warning("checkpoint %s does not verify: %s", folder, "; ".join(result.problems))
            known = self._verified[folder] = (stamp, result.ok)
        return known[1]

    def apply(self, step: int, keep: set[Path] | frozenset[Path] = frozenset()) -> None:
        """Keep the newest keep_last *valid* checkpoints; a broken one never counts as kept. `keep`: folders
        still needed (being sent to S3), left for a later pass.

        Deleted: valid ones beyond keep_last, and broken ones older than the newest valid one (nothing would
        ever resume from them). A broken one newer than every valid one stays until its step is saved again
        (then it is replaced).
        """
        valid: list[Path] = []
        doomed: list[Path] = []
        for _, folder in reversed(committed_checkpoints(self._directory)):  # newest first
            if folder in keep:
                continue
            if self.is_valid(folder):
                (valid if len(valid) < self._keep_last else doomed).append(folder)
            elif valid:
                doomed.append(folder)
        for folder in doomed:
            log.info("retention: deleting %s", folder)
            deleting = folder.with_name(folder.name + ".deleting")
            folder.rename(deleting)
            self._verified.pop(folder, None)
            self._save_point("retention", step)
            shutil.rmtree(deleting, ignore_errors=True)
